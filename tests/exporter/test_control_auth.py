"""The exporter's check of the operator's control token (moe_eplb.exporter.control_auth)."""

from __future__ import annotations

from moe_eplb.contracts import k8s_names
from moe_eplb.exporter.control_auth import Refusal, check


def test_the_right_token_passes_and_nothing_else_does(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")  # a trailing newline (an editor's, or echo's) is not part of it
    f = str(token)
    assert check({"Authorization": "Bearer s3cret-token"}, f) is None
    assert check({"authorization": "Bearer s3cret-token"}, f) is None  # header names are case-insensitive
    assert check({}, f) == Refusal(401, check({}, f).reason)
    assert "Authorization: Bearer <token>" in check({}, f).reason
    assert check({"Authorization": "Basic s3cret-token"}, f).status == 401
    assert check({"Authorization": "Bearer s3cret-tokeN"}, f).status == 403
    assert check({"Authorization": "Bearer "}, f).status == 403
    assert check({"Authorization": "Bearer s3cret-token-and-more"}, f).status == 403


def test_a_pod_without_the_token_refuses_every_control_request(tmp_path, monkeypatch):
    monkeypatch.delenv(k8s_names.CONTROL_TOKEN_FILE_ENV, raising=False)
    refused = check({"Authorization": "Bearer anything"})
    assert refused.status == 503 and k8s_names.CONTROL_TOKEN_FILE_ENV in refused.reason
    empty = tmp_path / "token"
    empty.write_text("")
    assert check({"Authorization": "Bearer "}, str(empty)).status == 503  # an empty file is no token
    assert check({"Authorization": "Bearer x"}, str(tmp_path / "missing")).status == 503


def test_the_file_named_by_the_environment_is_read_at_every_check(tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("old")
    monkeypatch.setenv(k8s_names.CONTROL_TOKEN_FILE_ENV, str(token))
    assert check({"Authorization": "Bearer old"}) is None
    token.write_text("new")  # the Secret rotated and the kubelet refreshed the mount
    assert check({"Authorization": "Bearer old"}).status == 403
    assert check({"Authorization": "Bearer new"}) is None
