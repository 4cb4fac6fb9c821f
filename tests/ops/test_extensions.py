"""The C++ kernels' build: the headers the sources share rebuild them when they change."""

from __future__ import annotations

import pytest
import torch.utils.cpp_extension

from clusterformer.ops import extensions


def test_a_header_edit_changes_every_builds_flags(tmp_path, monkeypatch):
    """torch's build cache hashes an extension's sources and flags, not the headers they include: the headers' digest
    is a define in the flags, so that an edit to a header rebuilds the extensions as an edit to a source does."""
    for stem in ("listed_attention", "spherical_assignment"):  # the sources that share rows.h
        assert '#include "rows.h"' in (extensions.CSRC / f"{stem}.cpp").read_text()
    flags = []
    monkeypatch.setattr(torch.utils.cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: flags.append(kwargs["extra_cflags"]))
    monkeypatch.setattr(extensions, "_build_directory", lambda name: tmp_path / "build")
    monkeypatch.setenv("CLUSTERFORMER_NO_EXTENSIONS", "0")
    headers = tmp_path / "csrc"
    headers.mkdir()
    monkeypatch.setattr(extensions, "CSRC", headers)
    (headers / "rows.h").write_text("// one\n")
    extensions.CppExtension("listed_attention", "a kernel").load()
    (headers / "rows.h").write_text("// two\n")
    extensions.CppExtension("listed_attention", "a kernel").load()
    defines = [[flag for flag in cflags if flag.startswith("-DCLUSTERFORMER_HEADERS=")] for cflags in flags]
    assert len(defines) == 2 and all(len(d) == 1 for d in defines)
    assert defines[0] != defines[1]


@pytest.mark.parametrize("edit", ["content", "name"])
def test_the_digest_follows_each_header(tmp_path, monkeypatch, edit):
    monkeypatch.setattr(extensions, "CSRC", tmp_path)
    (tmp_path / "a.h").write_text("int a;\n")
    (tmp_path / "b.h").write_text("int b;\n")
    (tmp_path / "source.cpp").write_text("int c;\n")
    before = extensions.header_digest()
    if edit == "content":
        (tmp_path / "b.h").write_text("int b = 1;\n")
    else:
        (tmp_path / "b.h").rename(tmp_path / "c.h")
    after = extensions.header_digest()
    assert after != before
    (tmp_path / "source.cpp").write_text("int d;\n")  # a source is torch's to hash, not the digest's
    assert extensions.header_digest() == after
