"""A standalone controller's keys: one private folder for the controller, one for the executors, one per client;
a client's folder holds its own secret and the servers' public keys, never another client's key; the servers
admit every client; bad client names and a used folder are refused, naming the value and the fix."""

from __future__ import annotations

import os
import stat

import pytest

from pathways_torch.launch import ServiceKeyFolders, make_service_keys, service_folders
from pathways_torch.launch.service_keys import ADMIN_TOKEN, admin_token, check_client_names, client_name, client_role
from pathways_torch.wire.security import CLIENT, CONTROLLER, KeyDirectory, SecurityError

SERVERS = ["controller.key", "executor-0.key", "executor-1.key", "executor-2.key"]


def _listing(folder, sub):
    return sorted(os.listdir(os.path.join(folder, sub)))


@pytest.mark.timeout(30)
def test_the_layout_is_private_folders_with_private_files(tmp_path):
    root = str(tmp_path / "keys")
    folders = make_service_keys(root, ["alice", "bob"], executors=3)
    assert folders == ServiceKeyFolders(root=root, controller=os.path.join(root, "controller"),
                                        executors=os.path.join(root, "executors"),
                                        clients={"alice": os.path.join(root, "clients", "alice"),
                                                 "bob": os.path.join(root, "clients", "bob")})
    assert sorted(os.listdir(root)) == ["clients", "controller", "executors"]   # the scratch folder is gone
    assert sorted(os.listdir(os.path.join(root, "clients"))) == ["alice", "bob"]
    for directory, _, files in os.walk(root):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700, directory
        for name in files:
            assert stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode) == 0o600, name
    with pytest.raises(TypeError):
        folders.clients["carol"] = "x"        # read-only
    assert service_folders(root) == folders


@pytest.mark.timeout(30)
def test_each_client_folder_holds_its_own_secret_and_only_the_servers_public_keys(tmp_path):
    folders = make_service_keys(str(tmp_path / "keys"), ["alice", "bob"], executors=3)
    for name, folder in folders.clients.items():
        assert _listing(folder, "secret") == [f"client-{name}.key_secret"]
        assert _listing(folder, "public") == sorted([*SERVERS, f"client-{name}.key"])
    assert _listing(folders.controller, "secret") == ["controller.key_secret"]
    assert _listing(folders.executors, "secret") == ["executor-0.key_secret", "executor-1.key_secret",
                                                     "executor-2.key_secret"]


@pytest.mark.timeout(30)
def test_the_servers_allow_list_admits_every_client_with_the_key_its_folder_holds(tmp_path):
    folders = make_service_keys(str(tmp_path / "keys"), ["alice", "bob"], executors=3)
    everyone = sorted([*SERVERS, "client-alice.key", "client-bob.key"])
    assert _listing(folders.controller, "public") == _listing(folders.executors, "public") == everyone
    allowed = KeyDirectory(folders.controller).public_keys()
    assert allowed == KeyDirectory(folders.executors).public_keys()
    for name, folder in folders.clients.items():
        own = KeyDirectory(folder).credentials(client_role(name))
        assert allowed[client_role(name)] == own.keys.public
        assert own.public_key(CONTROLLER) == allowed[CONTROLLER]       # the client knows the real servers
        assert own.public_key("executor-2") == allowed["executor-2"]


@pytest.mark.timeout(30)
def test_each_folder_gives_credentials_for_its_own_roles_and_no_other(tmp_path):
    folders = make_service_keys(str(tmp_path / "keys"), "alice,bob", executors=2)
    assert KeyDirectory(folders.controller).credentials(CONTROLLER).role == CONTROLLER
    for executor in ("executor-0", "executor-1"):
        assert KeyDirectory(folders.executors).credentials(executor).role == executor
    for name, folder in folders.clients.items():
        assert KeyDirectory(folder).credentials(client_role(name)).role == f"client-{name}"
    with pytest.raises(SecurityError, match="client-bob"):
        KeyDirectory(folders.clients["alice"]).credentials("client-bob")
    with pytest.raises(SecurityError, match="controller"):
        KeyDirectory(folders.executors).credentials(CONTROLLER)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("names, bad", [
    (["Alice"], "'Alice'"), ([""], "''"), ("", "none"), (["alice", "bob", "alice"], "'alice' more than once"),
    (["client-bob"], "'client-bob'"), (["a" * 33], "'" + "a" * 33 + "'"), (["1st"], "'1st'"),
])
def test_a_bad_client_name_is_refused_naming_the_value_and_the_fix(tmp_path, names, bad):
    with pytest.raises(ValueError, match="--clients: expected") as error:
        check_client_names(names)
    assert bad in str(error.value)
    assert "pass --clients" in str(error.value) or "rename" in str(error.value) or "once" in str(error.value)
    with pytest.raises(ValueError):
        make_service_keys(str(tmp_path / "keys"), names)
    assert not os.path.exists(tmp_path / "keys")              # nothing written
    assert check_client_names(["a" * 32, "b_2"]) == ("a" * 32, "b_2")


@pytest.mark.timeout(30)
def test_a_used_folder_or_no_executors_is_refused(tmp_path):
    root = str(tmp_path / "keys")
    make_service_keys(root, ["alice"], executors=1)
    with pytest.raises(SecurityError, match="expected a new or empty folder.*pick a new folder"):
        make_service_keys(root, ["alice"], executors=1)
    with pytest.raises(ValueError, match="--executors: expected an integer >= 1, got 0"):
        make_service_keys(str(tmp_path / "other"), ["alice"], executors=0)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert make_service_keys(str(empty), ["alice"], executors=1).clients == {"alice": str(empty / "clients" /
                                                                                          "alice")}


@pytest.mark.timeout(30)
def test_service_folders_of_a_missing_or_incomplete_dir_name_what_is_missing_and_the_fix(tmp_path):
    with pytest.raises(SecurityError, match=r"expected the folder .*missing.*found none; run pathways-controller "
                                            r"--make-keys"):
        service_folders(str(tmp_path / "missing"))
    root = str(tmp_path / "keys")
    make_service_keys(root, ["alice"], executors=1)
    os.rename(os.path.join(root, "executors"), os.path.join(root, "moved"))
    with pytest.raises(SecurityError, match=r"executors, found none; run pathways-controller --make-keys"):
        service_folders(root)
    os.rename(os.path.join(root, "moved"), os.path.join(root, "executors"))
    os.chmod(os.path.join(root, "clients", "alice"), 0o755)
    with pytest.raises(SecurityError, match="chmod 700"):
        service_folders(root)


@pytest.mark.timeout(30)
def test_client_role_and_client_name_round_trip_and_other_roles_are_no_client(tmp_path):
    assert client_role("alice") == "client-alice" and client_name("client-alice") == "alice"
    for name in ("bob", "a", "x" * 32, "team_7"):
        assert client_name(client_role(name)) == name
    for role in (CLIENT, "client", "executor-1", CONTROLLER, "client-", "client-Bob", "client-a.r1", None):
        assert client_name(role) is None, role
    with pytest.raises(ValueError, match="'Bob'.*rename it .e.g. 'bob'"):
        client_role("Bob")


@pytest.mark.timeout(30)
def test_the_admin_token_is_written_private_into_the_controller_folder_alone(tmp_path):
    """Issue 46 point 8: the operator's levers need a token only the controller's folder holds."""
    root = str(tmp_path / "keys")
    folders = make_service_keys(root, ["alice"], executors=1)
    path = os.path.join(folders.controller, ADMIN_TOKEN)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and os.stat(path).st_uid == os.getuid()
    token = admin_token(root)
    assert len(token) == 64 and int(token, 16) >= 0                      # 32 random bytes, as hex
    assert admin_token(folders.controller) == token                      # DIR or DIR/controller
    assert token not in "".join(open(os.path.join(d, f)).read() for d, _, files in os.walk(root)
                                for f in files if f != ADMIN_TOKEN and "secret" not in d)
    for folder in (folders.executors, folders.clients["alice"]):
        assert ADMIN_TOKEN not in [f for _, _, files in os.walk(folder) for f in files]
    assert admin_token(make_service_keys(str(tmp_path / "other"), ["alice"], executors=1).root) != token


@pytest.mark.timeout(30)
def test_a_missing_or_readable_admin_token_is_refused_naming_the_fix(tmp_path):
    root = str(tmp_path / "keys")
    folders = make_service_keys(root, ["alice"], executors=1)
    path = os.path.join(folders.controller, ADMIN_TOKEN)
    os.chmod(path, 0o644)
    with pytest.raises(SecurityError, match=r"expected a plain file of mode 0600 .* got mode 0644 .* chmod 600"):
        admin_token(root)
    os.remove(path)
    with pytest.raises(SecurityError, match=r"admin.token, found none; pass --keys-dir DIR"):
        admin_token(root)
    made = admin_token(root, create=True)                                # keys made before tokens: the controller
    assert admin_token(root) == made and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with open(path, "w") as file:
        file.write("not hex")
    with pytest.raises(SecurityError, match="expected 64 hex digits"):
        admin_token(root)
