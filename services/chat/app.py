"""Wiring of the chat process. The product API joins with the relay/chat issue."""

import logging

from fastapi import FastAPI

from tandem.config import Settings
from tandem.service import Runtime, RuntimeConfig, create_app

ROLE = "chat"
log = logging.getLogger(__name__)


def build_app(settings: Settings) -> FastAPI:
    if not settings.api_keys:
        log.warning("TANDEM_API_KEYS is empty: every API request will be refused with 401")
    runtime = Runtime(RuntimeConfig.from_settings(ROLE, settings, uses_redis=True))
    return create_app(runtime)
