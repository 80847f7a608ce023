"""fastdl's version: the one place it is written (pyproject.toml reads it from here; ``fastdl.__version__``,
``fastdl info`` and the conversion recipe import it)."""

__version__ = "0.1.0"
