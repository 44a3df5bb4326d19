from services.decode.app import ROLE, build_app
from tandem.runtime import run_service

run_service(ROLE, build_app)
