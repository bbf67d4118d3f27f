"""One run per folder (orlhf/storage/runlock.py) with real processes: a second `orlhf train-ppo` on a held folder exits
at
once naming the holder's pid; a kill -9 frees the lock; temp folders are removed only once their writer is gone;
the final export (orlhf/launch/export.py) survives a kill mid-write."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orlhf.launch.export import export_actor
from orlhf.storage.checkpoint import CheckpointManager
from orlhf.storage.runlock import FolderLock, RunLockError, hold_folders, owner_gone, write_owner

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def spawn(code: str) -> subprocess.Popen:
    """A python process running `code`; it prints 'ready' once set up, then waits to be killed."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=ENV, stdout=subprocess.PIPE, text=True)


def wait_ready(proc: subprocess.Popen) -> None:
    assert proc.stdout.readline().strip() == "ready"


def hold(save: Path, ckpt: Path) -> subprocess.Popen:
    proc = spawn(f"""
        import time
        from orlhf.storage.runlock import hold_folders
        with hold_folders({str(save)!r}, {str(ckpt)!r}, "firstrun0001"):
            print("ready", flush=True)
            time.sleep(600)
    """)
    wait_ready(proc)
    return proc


def train_ppo(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orlhf.cli", "train-ppo", "--device", "cpu", *flags],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_second_orlhf_run_on_a_held_folder_exits_at_once_naming_the_holder(tmp_path):
    save = tmp_path / "run"
    holder = hold(save, save / "checkpoints_ppo")
    try:
        t0 = time.monotonic()
        second = train_ppo("--save_path", str(save))
        assert second.returncode == 1, second.stderr
        assert f"--save_path {save} is in use by another orlhf run (pid {holder.pid} on" in second.stderr
        assert "run id firstrun0001" in second.stderr and f"kill {holder.pid}" in second.stderr
        assert time.monotonic() - t0 < 60 and "ray" not in second.stderr.lower()  # before Ray starts
        assert not (save / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    with hold_folders(str(save), str(save / "checkpoints_ppo"), "next"):  # kill -9 released it
        pass


def test_a_shared_checkpoint_folder_alone_is_refused_too(tmp_path):
    shared = tmp_path / "ckpt"
    holder = hold(tmp_path / "a", shared)
    try:
        second = train_ppo("--save_path", str(tmp_path / "b"), "--ckpt_path", str(shared))
        assert second.returncode == 1 and f"--ckpt_path {shared} is in use" in second.stderr, second.stderr
        assert f"pid {holder.pid}" in second.stderr
    finally:
        holder.kill()
        holder.wait()


def test_same_process_second_lock_is_refused_and_same_folder_is_locked_once(tmp_path):
    with FolderLock(tmp_path, "r1", "--save_path"):
        with pytest.raises(RunLockError, match=f"pid {os.getpid()}"):
            with FolderLock(tmp_path, "r2", "--save_path"):
                pass
    with hold_folders(str(tmp_path), str(tmp_path), "r3"):  # --ckpt_path == --save_path: no self-deadlock
        pass


def test_only_temp_folders_whose_writer_is_gone_are_removed(tmp_path):
    live = spawn('print("ready", flush=True)\nimport time\ntime.sleep(600)')
    wait_ready(live)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mgr = CheckpointManager(tmp_path, 3, run_id="me")
    in_flight, crashed = mgr.begin(4), mgr.begin(6)
    for folder, pid in ((in_flight, live.pid), (crashed, dead.pid)):
        rec = json.loads((folder / "owner.json").read_text())
        (folder / "owner.json").write_text(json.dumps({**rec, "pid": pid}))
    try:
        assert mgr.cleanup_stale_tmp() == [crashed]
        assert in_flight.exists() and not crashed.exists() and not owner_gone(in_flight)
    finally:
        live.kill()
        live.wait()
    assert owner_gone(in_flight) and mgr.cleanup_stale_tmp() == [in_flight]


def test_a_checkpoint_being_deleted_is_removed_whoever_wrote_it(tmp_path):
    """A .trash-step_* folder is a complete checkpoint half-way through deletion: nobody writes it, so cleanup
    removes it even when its owner.json names a live process (the run that committed it)."""
    trash = tmp_path / ".trash-step_000002-abcdef12"
    trash.mkdir()
    write_owner(trash, "other")
    rec = json.loads((trash / "owner.json").read_text())
    (trash / "owner.json").write_text(json.dumps({**rec, "pid": 1}))  # pid 1 (init) is always alive
    assert CheckpointManager(tmp_path, 3).cleanup_stale_tmp() == [trash] and not trash.exists()


class FakeActorGroup:
    """Stands in for the actor ActorGroup (only its call(PolicyWorker.save_hf, dir)): the file protocol is under
    test."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def call(self, method, out: str) -> "FakeActorGroup":
        assert method.__qualname__ == "PolicyWorker.save_hf"
        (Path(out) / "model.safetensors").write_bytes(self.payload)
        (Path(out) / "config.json").write_text("{}")
        return self

    def get(self) -> list:
        return [None]


def test_export_swaps_in_the_new_model_and_a_kill_mid_export_keeps_the_old_one(tmp_path):
    out = tmp_path / "actor"
    export_actor(FakeActorGroup(b"v1" * 100), out, "r1")
    assert (out / "model.safetensors").read_bytes() == b"v1" * 100 and not (out / "owner.json").exists()
    # a real process dies (kill -9) in the middle of writing the next export
    victim = spawn(f"""
        import time
        from pathlib import Path
        from orlhf.launch.export import export_actor

        class Slow:
            def call(self, method, out):
                (Path(out) / "model.safetensors").write_bytes(b"half")
                print("ready", flush=True)
                time.sleep(600)

        export_actor(Slow(), {str(out)!r}, "r2")
    """)
    wait_ready(victim)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert (out / "model.safetensors").read_bytes() == b"v1" * 100  # still the whole previous model
    (leftover,) = tmp_path.glob(".tmp-actor-*")
    export_actor(FakeActorGroup(b"v2" * 100), out, "r3")  # the next export removes the dead one's folder
    assert (out / "model.safetensors").read_bytes() == b"v2" * 100
    assert not leftover.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["actor"]


def test_a_live_exports_temp_folder_is_kept(tmp_path):
    tmp = tmp_path / ".tmp-actor-abcdef12"
    tmp.mkdir()
    write_owner(tmp, "other")
    rec = json.loads((tmp / "owner.json").read_text())
    (tmp / "owner.json").write_text(json.dumps({**rec, "pid": 1}))  # pid 1 (init) is always alive
    export_actor(FakeActorGroup(b"x"), tmp_path / "actor", "me")
    assert tmp.exists()


class FakeCriticGroup:
    """Stands in for the critic ActorGroup (only call(CriticWorker.save_value_network, dir)); `fail` writes half a
    model, then raises, as a full disk would."""

    def __init__(self, payload: bytes, fail: bool = False):
        self.payload, self.fail, self.dirs = payload, fail, []

    def call(self, method, out: str) -> "FakeCriticGroup":
        assert method.__qualname__ == "CriticWorker.save_value_network"
        self.dirs.append(Path(out))
        Path(out).mkdir(parents=True, exist_ok=True)  # as the worker's save_value_network does
        (Path(out) / "model.safetensors").write_bytes(self.payload[:1] if self.fail else self.payload)
        if self.fail:
            raise OSError(28, "No space left on device")
        (Path(out) / "config.json").write_text("{}")
        return self

    def get(self) -> list:
        return [None]


def test_save_value_network_exports_the_critic_atomically(tmp_path):
    """--save_value_network goes through the actor's atomic export: a failure mid-write keeps the previous critic."""
    from types import SimpleNamespace

    from orlhf.config.flags import build_config
    from orlhf.launch.export import ExportError
    from orlhf.launch.run import finish_run

    cfg = build_config({"save_path": str(tmp_path), "save_value_network": True}, {"save_value_network"})
    metrics = SimpleNamespace(plot=lambda: None, path=tmp_path / "metrics.jsonl")
    critic = FakeCriticGroup(b"c1" * 100)
    ctl = SimpleNamespace(step_index=3, checkpoints=None, cfg=cfg, stop_signal=None)  # export_failed reads these
    finish_run(cfg, SimpleNamespace(actor=FakeActorGroup(b"a1"), critic=critic), metrics, [], "r1", ctl)
    assert critic.dirs[0].name.startswith(".tmp-critic-")  # written aside, then swapped in
    assert (tmp_path / "critic" / "model.safetensors").read_bytes() == b"c1" * 100
    with pytest.raises(ExportError, match="could not export to .*critic: no space left on "):
        finish_run(
            cfg,
            SimpleNamespace(actor=FakeActorGroup(b"a2"), critic=FakeCriticGroup(b"c2" * 100, fail=True)),
            metrics,
            [],
            "r2",
            ctl,
        )
    assert (tmp_path / "critic" / "model.safetensors").read_bytes() == b"c1" * 100  # still the whole previous one
    assert (tmp_path / "actor" / "model.safetensors").read_bytes() == b"a2"
