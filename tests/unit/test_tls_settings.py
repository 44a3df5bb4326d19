"""TANDEM_TLS_*: a half-set certificate or a file that is not there stops a process at start,
naming the setting, instead of failing at its first connection."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from tandem.devstack.certs import make_cert_set
from tandem.tls import TlsSettings


def test_a_certificate_without_its_key_or_a_missing_file_is_refused_at_start(tmp_path: Path):
    certs = make_cert_set(tmp_path)
    assert TlsSettings(**certs.settings("chat").model_dump()).is_enabled
    with pytest.raises(pydantic.ValidationError, match="together"):
        TlsSettings(ca_file=str(certs.ca_file), cert_file=str(certs.cert_file("chat")))
    with pytest.raises(pydantic.ValidationError, match="TANDEM_TLS_CA_FILE"):
        TlsSettings(ca_file=str(tmp_path / "nowhere.pem"))
    assert not TlsSettings(ca_file="").is_enabled
