"""Joining a running Ray cluster (--address, RAY_ADDRESS): a cluster that refuses this process (Ray's token
authentication) is one RayJoinError line saying what to set, at its first refusal instead of after Ray's connect
window; without --verbose, Ray's C++ lines go to driver.log while it connects.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from contextlib import contextmanager
from typing import Optional


class RayJoinError(Exception):
    """The cluster given by --address / RAY_ADDRESS refused this process; the message says what to set."""


def join_cluster(address: str, verbose: bool = False, **init_kwargs) -> None:
    """ray.init(address=...) of a running cluster. A cluster with token authentication that refuses this process's
    token raises RayJoinError at its first refusal: Ray would retry for its whole connect window, its C++ client
    printing a warning at each try. Without `verbose` Ray's C++ lines go to driver.log (os.devnull outside a run)
    instead of the terminal while it connects."""
    import ray

    # Ray retries an address that does not answer for minutes; with its own lines aside, say so once.
    waiting = threading.Timer(JOIN_NOTICE_S, _still_joining, (address,))
    waiting.daemon = True
    try:
        with native_stderr_aside(enabled=not verbose), _first_auth_refusal_ends_the_retries():
            waiting.start()
            ray.init(address=address, **init_kwargs)
    except _AuthRefused as e:
        raise RayJoinError(auth_hint(address, e.error)) from None
    except Exception as e:  # noqa: BLE001 - only an authentication refusal is translated, the rest raised again
        refusal = auth_refusal(e)
        if refusal is None:
            raise
        raise RayJoinError(auth_hint(address, refusal)) from None
    finally:
        waiting.cancel()


JOIN_NOTICE_S = 15.0


def _still_joining(address: str) -> None:
    logging.getLogger("orlhf").warning(
        "the Ray cluster at %s has not answered for %.0f s; Ray keeps trying for minutes: check the address",
        address,
        JOIN_NOTICE_S,
    )


NO_TOKEN = "no authentication token was found"  # Ray's message when RAY_AUTH_MODE=token finds no token


def auth_refusal(error: BaseException) -> Optional[BaseException]:
    """The authentication error in `error`'s chain, if any. Ray raises its AuthenticationError itself when
    RAY_AUTH_MODE=token finds no token, and a ConnectionError caused by a RuntimeError that quotes the
    AuthenticationError's traceback when the cluster refused the token (or got none)."""
    seen = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(e):
            return e
        e = e.__cause__ or e.__context__
    return None


def auth_hint(address: str, error: BaseException, environ=os.environ) -> str:
    """One line: which cluster refused, why as far as this process's variables tell, and what to set."""
    where = f"the Ray cluster at {address} uses token authentication"
    token = (
        "RAY_AUTH_TOKEN to the cluster's token, or RAY_AUTH_TOKEN_PATH to a file holding it "
        "(`ray get-auth-token` on its head node prints the token)"
    )
    if environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return f"{where} and RAY_AUTH_MODE is not 'token' here: set RAY_AUTH_MODE=token and {token}"
    if NO_TOKEN in str(error):
        return f"{where} and no token is set here: set {token}"
    given = environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token"
    given = "RAY_AUTH_TOKEN" if environ.get("RAY_AUTH_TOKEN") else given
    return f"{where} and refused the token from {given}: set {token}"


class _AuthRefused(BaseException):
    """Not an Exception, so that Ray's connect loop (which retries on any Exception) lets it through."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


@contextmanager
def _first_auth_refusal_ends_the_retries():
    """While ray.init connects: a GCS client that the cluster refuses for its token ends the connect at once. Ray
    2.60's Node._init_gcs_client retries every failure (NUM_REDIS_GET_RETRIES times, a second apart), and a refused
    token stays refused. Where Ray
    has no such name (another version) nothing changes: auth_refusal still reads the error ray.init ends with."""
    from ray._private import node

    original = getattr(node, "GcsClient", None)
    if original is None:
        yield
        return

    def client(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except Exception as e:
            if auth_refusal(e) is not None:
                raise _AuthRefused(e) from e
            raise

    node.GcsClient = client
    try:
        yield
    finally:
        node.GcsClient = original


@contextmanager
def native_stderr_aside(enabled: bool = True):
    """Point file descriptor 2 (what Ray's C++ code prints to) at driver.log, or os.devnull outside a run, for the
    duration. Python's sys.stderr, when it writes to descriptor 2, is swapped for a copy of the terminal's descriptor
    meanwhile, so orlhf's own lines (the inputs thread logs while Ray connects) still reach the terminal."""
    from orlhf.storage.logs import worker_log_path

    if not enabled:
        yield
        return
    try:
        target = os.open(worker_log_path("driver") or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:  # an unwritable log folder: leave the terminal as it is
        yield
        return
    python_stderr = sys.stderr
    python_stderr.flush()
    saved = os.dup(2)
    terminal = None
    if _fileno(python_stderr) == 2:
        # Left open afterwards (closed with its last reference): a handler made meanwhile may hold it.
        terminal = os.fdopen(os.dup(saved), "w", buffering=1, encoding=python_stderr.encoding, errors="replace")
        sys.stderr = terminal
    os.dup2(target, 2)
    os.close(target)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        if terminal is not None and sys.stderr is terminal:
            terminal.flush()
            sys.stderr = python_stderr


def _fileno(stream) -> Optional[int]:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # a test's captured stream, a closed one
        return None
