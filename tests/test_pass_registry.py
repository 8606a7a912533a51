"""The pass registry's one line when a pass module cannot be imported: built-in (a broken install) or a plugin."""
from __future__ import annotations

import pytest

from optpipe.passes import registry


def test_a_builtin_pass_that_cannot_import_blames_the_install_not_the_plugin_variable(monkeypatch):
    """A library a built-in pass imports is missing: one line that says to reinstall, not to fix OPTPIPE_PLUGINS
    (which the user never set); a plugin named in the variable keeps its own line."""
    import importlib

    from optpipe.core.errors import OptpipeError

    real = importlib.import_module

    def broken(name, *args, **kwargs):
        if name == "optpipe.passes.fuse":
            raise ImportError("No module named 'onnxruntime.transformers'")
        return real(name, *args, **kwargs)

    monkeypatch.delenv("OPTPIPE_PLUGINS", raising=False)
    monkeypatch.setattr(importlib, "import_module", broken)
    registry.cache_clear()
    try:
        with pytest.raises(OptpipeError) as caught:
            registry()
        said = str(caught.value)
        assert "optpipe.passes.fuse" in said and "reinstall optpipe" in said and "OPTPIPE_PLUGINS" not in said
        monkeypatch.setenv("OPTPIPE_PLUGINS", "no_such_plugin_xyz")
        monkeypatch.setattr(importlib, "import_module", real)
        registry.cache_clear()
        with pytest.raises(OptpipeError, match="OPTPIPE_PLUGINS: cannot import pass module 'no_such_plugin_xyz'"):
            registry()
    finally:
        registry.cache_clear()
