"""Import stub for `torchao` (see ../README.md): SGLang's model runner imports it even with no `--torchao-config`,
and then returns before using anything from it."""

from _kvgate_stub import stub_package

stub_package(globals())
