"""Import stubs for the CUDA-only wheels SGLang's import path names but its request path never calls.

`stub_package(globals())` makes the calling package, and every submodule of it, importable: any attribute at any
depth is an inert placeholder (a class can even derive from one), and calling one raises, so a use on the request
path would show up as an SGLang error in the parity run, never as a silently different count."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any


class Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # used as a decorator (`@torch.library.custom_op`-style registration): hand the function back
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        raise RuntimeError(f"stub {self._name} called: the parity driver stubs this CUDA-only package")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)

    def __bool__(self) -> bool:
        return False


class StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self.__name__}.{attr}")


class _Finder:
    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def stub_package(namespace: dict[str, Any]) -> None:
    name = namespace["__name__"]
    sys.meta_path.insert(0, _Finder(name))
    module = sys.modules[name]
    module.__class__ = StubModule
    namespace.setdefault("__version__", "0.0.0+kvgate.stub")
