"""A work folder's bus users: the instances it admits are rendered into the auth file every
server config of the folder includes, each with its own derived password, once."""

from __future__ import annotations

from pathlib import Path

from tandem.bus.permissions import Identity
from tandem.devstack.bus_users import AUTH_FILE, admit, admitted, write_auth
from tandem.devstack.secrets import load_or_create


def test_an_admitted_instance_is_rendered_once_with_its_own_password_and_a_second_admit_changes_nothing(tmp_path: Path):
    made = load_or_create(tmp_path)
    assert write_auth(tmp_path, made) == f'include "{AUTH_FILE}"\n'
    assert '"decode-0"' not in (tmp_path / AUTH_FILE).read_text()
    assert admit(tmp_path, made, [Identity("decode", "decode-0"), Identity("router", "router-0")])
    assert not admit(tmp_path, made, [Identity("decode", "decode-0")]), "nothing new: no reload needed"
    assert admitted(tmp_path) == [Identity("decode", "decode-0"), Identity("router", "router-0")]
    rendered = (tmp_path / AUTH_FILE).read_text()
    assert rendered.count('{user: "decode-0"') == 1
    assert f'password: "{made.instance_password("decode-0")}"' in rendered
    assert '"tandem.v1.worker.decode-0.assign"' in rendered and '"tandem.v1.worker.*.assign"' in rendered  # the router's
