"""Build the optional C++ scope engine (``tensorscope._fast``) with the machine's compiler.

Everything else is in pyproject.toml. Without a compiler the extension is skipped (setuptools'
``optional``) and tensorscope runs its pure-Python engine (tensorscope/_engine.py).
"""

from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # no torch in the build environment: pure Python
    extensions, commands = [], {}
else:
    extensions = [
        CppExtension(
            "tensorscope._fast",
            [
                "tensorscope/csrc/fast.cpp",
                "tensorscope/csrc/managed.cpp",
                "tensorscope/csrc/optable.cpp",
            ],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        # The storage door for torch without UntypedStorage._swap_data_ptr_ (tensorscope/_torch.py).
        CppExtension(
            "tensorscope._storage",
            ["tensorscope/csrc/storage.cpp"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
    commands = {"build_ext": BuildExtension}

setup(ext_modules=extensions, cmdclass=commands)
