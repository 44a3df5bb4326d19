"""The committed generated code must be what `make protos` produces from protos/ now."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GENERATED = REPO / "libs" / "tandem" / "v1"


def _generate(out: Path) -> None:
    protos = sorted(str(p.relative_to(REPO)) for p in (REPO / "protos" / "tandem" / "v1").glob("*.proto"))
    protoc = [sys.executable, "-m", "grpc_tools.protoc", "-Iprotos"]
    subprocess.run([*protoc, f"--python_out={out}", f"--pyi_out={out}", *protos], cwd=REPO, check=True)
    services = ["protos/tandem/v1/control.proto", "protos/tandem/v1/kv_handoff.proto"]
    subprocess.run([*protoc, f"--grpc_python_out={out}", *services], cwd=REPO, check=True)


def test_generated_code_matches_the_protos(tmp_path: Path):
    _generate(tmp_path)
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "tandem" / "v1").iterdir()}
    committed = {p.name: p.read_bytes() for p in GENERATED.iterdir() if p.suffix in {".py", ".pyi"} and p.name != "__init__.py"}
    assert sorted(committed) == sorted(fresh), "run `make protos`: generated files differ from protos/"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"run `make protos`: stale generated code in {stale}"


def test_every_proto_has_generated_code():
    for proto in (REPO / "protos" / "tandem" / "v1").glob("*.proto"):
        assert (GENERATED / f"{proto.stem}_pb2.py").is_file(), proto.name
