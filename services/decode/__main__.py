from tandem.service import run_service
from tandem.worker import build_worker_app

run_service("decode", lambda settings: build_worker_app("decode", settings))
