"""pipefill: long-prompt LLM inference with chunked pipeline parallelism."""
from pipefill.config import ServerArgs
from pipefill.engine import Engine, GenerateOutput
from pipefill.base.plan import PDInfo, SamplingParams

__all__ = ["Engine", "GenerateOutput", "PDInfo", "SamplingParams", "ServerArgs"]
