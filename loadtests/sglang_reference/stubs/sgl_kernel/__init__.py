"""Import stub for `sgl_kernel` (see ../_kvgate_stub.py and ../README.md)."""

from _kvgate_stub import stub_package

stub_package(globals())
