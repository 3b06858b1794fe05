"""megatron_tree: exact, topology-aware context-parallel decoding (Tree Attention).

The core (the functional API, the sharded caches, the generation loop) installs with torch, triton and
numpy (plus pyyaml for the machine presets and tqdm for progress bars). Each framework comes with an
extra; a module that needs a missing one raises ImportError naming the extra
(``megatron_tree/utils/extras.py``):

    pip install megatron_tree                 # core: mt.tree_decode, mt.flash_decode, megatron_tree.decode
    pip install 'megatron_tree[hf]'           # + transformers models (mt.hf)
    pip install 'megatron_tree[megatron]'     # + Megatron-Core (mt.megatron)
    pip install 'megatron_tree[deepspeed]'    # + the DeepSpeed launcher, groups and config
    pip install 'megatron_tree[lmeval]'       # + the lm-evaluation-harness backend
    pip install 'megatron_tree[eval]'         # + the wandb-tracked eval run (hf, megatron, deepspeed, wandb, plots)
    pip install 'megatron_tree[all]'          # everything above
"""

from setuptools import find_packages, setup

HF = [
    # integrations/hf/ (transformers' own model classes, CP-sharded): written for 5.17 (the GPU machine's)
    # and tested with 5.17, 5.24 and 5.25; the cache and attention interfaces it fills changed in 5.x,
    # so the range stops at the next minor release nobody has tested.
    "transformers>=5.17,<5.26",
    "safetensors",
]
MEGATRON = [
    # 0.16.1 is the newest release for Python 3.11 (patches/ are pinned to it); 0.17+ need
    # Python >= 3.12, where 0.19.x is the release the module-slot integration is written for.
    "megatron-core>=0.16.1,<0.17; python_version < '3.12'",
    "megatron-core>=0.19,<0.20; python_version >= '3.12'",
]
DEEPSPEED = ["deepspeed>=0.19,<0.20"]  # the CPU shm-op switch in integrations/deepspeed.py is 0.19's
WANDB = ["wandb>=0.20"]
PLOT = ["matplotlib"]
# integrations/lm_eval.py (the backend); accelerate for lm-eval's own hf backend, the tests' reference;
# the ruler extra for RULER's niah tasks (wonderwords)
LMEVAL = ["lm-eval[ruler]==0.4.13", "accelerate", *HF]
EVAL = [*HF, *MEGATRON, *DEEPSPEED, *WANDB, *PLOT]
ALL = sorted(set(EVAL + LMEVAL))

setup(
    name="megatron_tree",
    version="0.1.0",
    description="Exact, topology-aware context-parallel decoding (Tree Attention) for Megatron-Core and DeepSpeed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_tree", "megatron_tree.*"]),
    package_data={"megatron_tree": ["comm/presets/*.yaml", "LAYERS.md"]},
    python_requires=">=3.10",
    install_requires=[
        # A range the machine's CPU build (2.13.0) satisfies; launch/setup.sh pins it first,
        # so pip does not pull a multi-GB CUDA build on CPU machines.
        "torch>=2.4",
        "triton>=3.6,<3.10",  # 3.6 on the GPU machine, 3.7.1 pinned by launch/setup.sh
        "numpy",
        "pyyaml",
        "tqdm",
    ],
    extras_require={
        "hf": HF,
        "megatron": MEGATRON,
        "deepspeed": DEEPSPEED,
        "wandb": WANDB,
        "plot": PLOT,
        "lmeval": LMEVAL,
        "eval": EVAL,
        "all": ALL,
        "test": ["pytest", "pytest-xdist", "pytest-timeout", "hypothesis", *ALL],
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
