"""The SGLang engine client: verified keep-alive connections, event streams, aborts, telemetry reads."""

from routing.engines.client import EngineClient, EngineResponse
from routing.engines.errors import (
                                    EngineBroken,
                                    EngineChanged,
                                    EngineError,
                                    EngineRejected,
                                    EngineTimeout,
                                    EngineUnreachable,
)
from routing.engines.identity import EngineIdentity

__all__ = ["EngineBroken", "EngineChanged", "EngineClient", "EngineError", "EngineIdentity", "EngineRejected",
           "EngineResponse", "EngineTimeout", "EngineUnreachable"]
