"""`EngineLimits` where the server's modules import it (it lives in `graphdraft.serving.limits`,
beside the Engine, whose `check_request` it is)."""

from graphdraft.serving.limits import EngineLimits

__all__ = ["EngineLimits"]
