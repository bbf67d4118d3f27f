"""The run folder's layout is named in one module (orlhf/storage/run_folder.py): no other module spells a file name of
it, so a rename there reaches every writer and reader."""

import ast
from pathlib import Path

from orlhf.storage.run_folder import RunFolder, best_checkpoints, checkpoint_hf_actor

ORLHF = Path(__file__).resolve().parents[2] / "orlhf"
FILES = (
    "run_config.json",
    "metrics.jsonl",
    "startup.json",
    "restarts.jsonl",
    "reward.png",
    "report.png",
    "report.html",
)


def test_the_layout_is_spelled_in_run_folder_only():
    folder = RunFolder.at("/runs/x")
    assert {getattr(folder, p).name for p in dir(RunFolder) if isinstance(getattr(RunFolder, p), property)} >= set(
        FILES
    )
    spelled = []
    for path in sorted(ORLHF.rglob("*.py")):
        if path.name == "run_folder.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in FILES:
                spelled.append(f"{path.relative_to(ORLHF.parent)}:{node.lineno} {node.value!r}")
    assert spelled == [], "use orlhf/storage/run_folder.py's RunFolder instead of spelling its names"


def test_paths_inside_the_checkpoint_folder():
    assert best_checkpoints("/ck") == Path("/ck/best")
    assert checkpoint_hf_actor("/ck/global_step4") == Path("/ck/global_step4/hf/actor")
    assert RunFolder.at("r").metrics == Path("r/metrics.jsonl") and RunFolder.at("r").logs == Path("r/logs")
