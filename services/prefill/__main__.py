from services.prefill.app import ROLE, build_app
from tandem.service import run_service

run_service(ROLE, build_app)
