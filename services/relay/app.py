"""Wiring of the relay process. Its token-log work joins with the relay/chat issue."""

from fastapi import FastAPI

from tandem.config import Settings
from tandem.service import Runtime, RuntimeConfig, create_app

ROLE = "relay"


def build_app(settings: Settings) -> FastAPI:
    runtime = Runtime(RuntimeConfig.from_settings(ROLE, settings, uses_redis=True))
    return create_app(runtime)
