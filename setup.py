"""orlhf: a Ray-based RLHF trainer. Versions live in orlhf/versions.py (one place)."""

import pathlib

from setuptools import find_packages, setup

HERE = pathlib.Path(__file__).parent
pins: dict = {}
exec((HERE / "orlhf" / "versions.py").read_text(), pins)

setup(
    name="orlhf",
    version="0.1.0",
    description="Ray-based RLHF (PPO and relatives) with DeepSpeed ZeRO-3 trainers and vLLM rollout engines",
    long_description=(HERE / "README.md").read_text() if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["orlhf", "orlhf.*"]),
    python_requires=">=3.10",
    install_requires=pins["CORE"],
    extras_require=pins["EXTRAS"],
    entry_points={"console_scripts": ["orlhf=orlhf.entry:main"]},
)
