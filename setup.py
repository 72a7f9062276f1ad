"""Packaging for megatron_auto.

torch is a range that the pinned development build (2.13) satisfies; install the CPU or CUDA
build you want first (``pip install torch==2.13.0``), otherwise pip may pull a large CUDA build.
NVIDIA apex (fused Adam) and Transformer Engine are optional accelerators that are not
installable from PyPI in a usable form: build them from their repositories; megatron_auto uses
them when they import and falls back to torch kernels otherwise.
"""

from setuptools import find_packages, setup

setup(
    name="megatron_auto",
    version="0.1.0",
    description="Megatron-style training whose per-layer parallel layout is searched (Galvatron-BMW)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_auto", "megatron_auto.*"]),
    package_data={"megatron_auto.data": ["assets/*"]},
    include_package_data=True,
    install_requires=["torch>=2.4", "numpy", "sentencepiece"],
    extras_require={
        # The test extra installs the optional packages too, so their tests run in CI instead
        # of skipping (version ranges we have run).
        "test": ["pytest>=9.0,<10", "tensorboard>=2.21,<3", "wandb>=0.31,<1", "matplotlib>=3.11,<4",
                 "transformers>=5.0,<6", "tqdm>=4.66,<5", "megatron-core>=0.16,<0.17",
                 # megatron-core's dist_checkpointing save waits forever on CPU without psutil
                 # (tests/test_mcore_checkpoint.py hung in a fresh venv; passes with it)
                 "psutil>=5.9",
                 # .ci/run type-checks the torch-free layers (mypy.ini); pinned: a new mypy
                 # release may find new errors in unchanged code
                 "mypy==2.4.1"],
        # Megatron-Core interop: its pipeline-layout parser checks our exported flags (pure Python
        # and torch; needs no CUDA for what we use); run with 0.16.1. psutil: its torch_dist save
        # hangs on CPU without it
        "mcore": ["megatron-core>=0.16,<0.17", "psutil>=5.9"],
        # tools/checkpoint/convert.py (Hugging Face GPT-2 / LLaMA / Megatron-BERT); run with 5.24
        "hf": ["transformers>=5.0,<6"],
        "plots": ["matplotlib>=3.11,<4"],
        "logging": ["tensorboard>=2.21,<3", "wandb>=0.31,<1"],
        # Progress bars on a terminal (plain lines without it).
        "progress": ["tqdm>=4.66,<5"],
        # apex / transformer-engine: build from source (see README); nothing installable here.
        "gpu": [],
    },
    entry_points={"console_scripts": ["megatron-auto = megatron_auto.console:main"]},
)
