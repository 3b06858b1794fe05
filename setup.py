"""megatron_tree: exact, topology-aware context-parallel decoding (Tree Attention)."""

from setuptools import find_packages, setup

setup(
    name="megatron_tree",
    version="0.1.0",
    description="Exact, topology-aware context-parallel decoding (Tree Attention) for Megatron-Core and DeepSpeed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_tree", "megatron_tree.*"]),
    package_data={"megatron_tree": ["presets/*.yaml"]},
    python_requires=">=3.10",
    install_requires=[
        # A range the machine's CPU build (2.13.0) satisfies; launch/setup.sh pins it first,
        # so pip does not pull a multi-GB CUDA build on CPU machines.
        "torch>=2.4",
        "triton>=3.6,<3.10",  # 3.6 on the GPU machine, 3.7.1 pinned by launch/setup.sh
        "numpy",
        "deepspeed>=0.19,<0.20",  # the CPU shm-op switch in integrations/deepspeed.py is 0.19's
        # 0.16.1 is the newest release for Python 3.11 (patches/ are pinned to it); 0.17+ need
        # Python >= 3.12, where 0.19.x is the release the module-slot integration is written for.
        "megatron-core>=0.16.1,<0.17; python_version < '3.12'",
        "megatron-core>=0.19,<0.20; python_version >= '3.12'",
        "wandb>=0.20",
        "pyyaml",
        "safetensors",
        "tqdm",
        "matplotlib",
        # integrations/hf/ (transformers' own model classes, CP-sharded); tested with 5.17 and 5.24
        "transformers>=5.17",
    ],
    extras_require={
        # integrations/lm_eval.py (the lm-evaluation-harness backend); accelerate for lm-eval's own hf
        # backend, the tests' reference; the ruler extra for RULER's niah tasks (wonderwords)
        "lmeval": ["lm-eval[ruler]==0.4.13", "accelerate"],
        "test": ["pytest", "pytest-xdist", "pytest-timeout", "hypothesis", "lm-eval[ruler]==0.4.13", "accelerate"],
    },
    entry_points={
        "console_scripts": [
            "megatron-tree-eval=megatron_tree.eval:main",
            "megatron-tree-generate=megatron_tree.eval.generate:main",
            "megatron-tree-demo=megatron_tree.eval.demo:main",
            "megatron-tree-lm-eval=megatron_tree.eval.lm_eval:main",
        ],
    },
)
