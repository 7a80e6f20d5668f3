"""One logging format for every pipefill process, set once at each entry point."""
from __future__ import annotations

import logging
import warnings


def setup_logging(level: str = "info", prefix: str = "pipefill") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()), force=True,
        format=f"%(asctime)s [{prefix}] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    # gguf's reader warns about every duplicated key; transformers about optional backends.
    warnings.filterwarnings("ignore", module="gguf")
    for noisy in ("transformers", "gguf", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
