from .data.param_server import PULL, PUSH, ParameterServer, busiest_link  # noqa: F401
