"""The configuration room: ServerArgs, every flag parsed once at the entry point (args.py), and
the frozen sections derived from it, each passed only where it is needed (sections.py;
ARCHITECTURE.md, 'Configuration')."""
from pipefill.config.args import (ServerArgs, add_server_args, flag_fields, make_server_args,
                                  resolve, server_args_from_namespace, server_args_parser_group)
from pipefill.config.sections import (Cache, Chunking, Disaggregation, DisaggMode, Kernels,
                                      Layout, Serving, StageInfo)

__all__ = ["Cache", "Chunking", "DisaggMode", "Disaggregation", "Kernels", "Layout", "ServerArgs",
           "Serving", "StageInfo", "add_server_args", "flag_fields", "make_server_args",
           "resolve", "server_args_from_namespace", "server_args_parser_group"]
