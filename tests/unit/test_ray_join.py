"""Joining a running Ray cluster (distributed/ray_join.py): a token-authentication refusal becomes one line that says
what to set, and Ray's C++ lines meanwhile go to driver.log. Reading each node's GPU memory from nvidia-smi's output
(distributed/placement.py). Pure: the exceptions are the ones Ray 2.60 raises (copied from a head started with
RAY_AUTH_MODE=token); tests/ray/test_ray_token_auth.py joins such a head."""

import os
import sys

import pytest
from ray.exceptions import AuthenticationError

from orlhf.distributed.placement import smallest_gpu_gib
from orlhf.distributed.ray_join import auth_hint, auth_refusal, native_stderr_aside

# str() of the RuntimeError under ray.init's ConnectionError, when the cluster refuses the token (or gets none)
GCS_REFUSED = (
    "Failed to connect to GCS. Last connection error: Traceback (most recent call last):\n"
    '  File "/work/main/.venv/lib/python3.11/site-packages/ray/_private/node.py", line 996, in _init_gcs_client\n'
    "    client = GcsClient(\n             ^^^^^^^^^^\n"
    '  File "python/ray/_raylet.pyx", line 3198, in ray._raylet.GcsClient.__cinit__\n'
    '  File "python/ray/includes/common.pxi", line 119, in ray._raylet.check_status\n'
    "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication token is missing or incorrect. "
    "Note: RAY_AUTH_MODE is currently 'disabled' (not 'token'). Ensure that the token for the cluster is available "
    "in a local file (e.g., ~/.ray/auth_token or via RAY_AUTH_TOKEN_PATH) or as the `RAY_AUTH_TOKEN` environment "
    "variable.\n"
)
# what ray.init raises itself when RAY_AUTH_MODE=token finds no token
NO_TOKEN = "Token authentication is enabled but no authentication token was found"
ADDRESS = "10.0.0.1:6379"


def refused() -> ConnectionError:
    try:
        try:
            raise RuntimeError(GCS_REFUSED)
        except RuntimeError as e:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from e
    except ConnectionError as e:
        return e


def test_a_refused_token_is_found_in_ray_inits_error_chain_and_nothing_else_is():
    assert isinstance(auth_refusal(refused()), RuntimeError)
    assert isinstance(auth_refusal(AuthenticationError(NO_TOKEN)), AuthenticationError)
    unreachable = ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")
    unreachable.__cause__ = RuntimeError("Failed to connect to GCS. Last connection error: ... Timed out")
    assert auth_refusal(unreachable) is None


@pytest.mark.parametrize(
    "environ, error, says",
    [
        ({}, refused(), "RAY_AUTH_MODE is not 'token' here: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to"),
        ({"RAY_AUTH_MODE": "token"}, AuthenticationError(NO_TOKEN), "no token is set here: set RAY_AUTH_TOKEN to"),
        ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "x"}, refused(), "refused the token from RAY_AUTH_TOKEN: set"),
        ({"RAY_AUTH_MODE": "TOKEN", "RAY_AUTH_TOKEN_PATH": "/t"}, refused(), "refused the token from /t: set"),
        ({"RAY_AUTH_MODE": "token"}, refused(), "refused the token from ~/.ray/auth_token: set"),
    ],
)
def test_the_hint_is_one_line_naming_the_address_and_what_to_set(environ, error, says):
    hint = auth_hint(ADDRESS, error, environ)
    assert "\n" not in hint and hint.startswith(f"the Ray cluster at {ADDRESS} uses token authentication and ")
    assert says in hint and "RAY_AUTH_TOKEN_PATH" in hint and "ray get-auth-token" in hint


def test_native_output_goes_to_driver_log_and_python_output_still_to_stderr(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("ORLHF_LOG_DIR", str(tmp_path))
    with native_stderr_aside():
        os.write(2, b"gcs_client.cc:210: Failed to get cluster ID\n")  # what Ray's C++ client prints
        print("[orlhf] prompts: 512 used", file=sys.stderr)
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert "prompts: 512 used" in err and "after" in err and "gcs_client" not in err
    assert "gcs_client.cc:210" in (tmp_path / "driver.log").read_text()
    with native_stderr_aside(enabled=False):  # --verbose: as it was
        os.write(2, b"shown\n")
    assert "shown" in capfd.readouterr().err


@pytest.mark.parametrize(
    "text, gib",
    [
        ("81559\n", 79.6),  # an H100 80GB, in MiB
        ("81559\n40960\n81559\n", 40.0),  # the smallest GPU of the node
        ("[N/A]\n81559\n", 79.6),
        ("[N/A]\n", None),
        ("", None),
        (None, None),  # nvidia-smi missing or failed
    ],
)
def test_nvidia_smi_memory_total_to_the_smallest_gpus_gib_rounded_down(text, gib):
    assert smallest_gpu_gib(text) == gib
