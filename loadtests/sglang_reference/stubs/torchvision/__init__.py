"""Import stub: torchvision's CUDA-era wheels do not import beside the CPU torch 2.13.0 used here, and SGLang's
request path never calls it (it serves image processing for multimodal models only). Every attribute, at every
depth, is an inert placeholder; calling one raises, so a use would show up as an SGLang error, not a wrong count."""

from __future__ import annotations

import sys
import types
from typing import Any


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"stub {self._name} called: the parity driver stubs torchvision")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


def install(name: str) -> None:
    """Make `name` and its submodules importable as stubs (import system finds them through the finder below)."""


class _Finder:
    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        import importlib.machinery

        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _Finder(__name__))
__version__ = "0.0.0+stub"
__path__: list[str] = list(globals().get("__path__", []))


def __getattr__(attr: str) -> Any:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Placeholder(f"{__name__}.{attr}")
