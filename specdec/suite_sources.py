"""The installed modules whose whole files the long and predicted-edits suites quote
(long_suite.py, predicted_edits.py): a module name each, so that training data
(corpus_files.collect_files) can leave those files out without importing the suites."""

#: Modules of several domains, each 60-400 lines (a module missing here is left out).
EDIT_SOURCES = (
    "h11._util", "h11._receivebuffer", "h11._writers", "rich._ratio", "rich._wrap", "rich.align",
    "rich._log_render", "starlette.convertors", "starlette.config", "starlette.authentication", "anyio.to_thread",
    "prometheus_client.samples", "prometheus_client.validation", "prometheus_client.mmap_dict",
    "fsspec.dircache", "fsspec.compression", "packaging._structures", "packaging._tokenizer",
    "pygments.regexopt", "pygments.style", "markdown_it.token", "markdown_it.ruler", "yaml.composer",
    "click._textwrap", "tqdm.utils", "huggingface_hub._revision",
)

#: Files of packages specdec itself installs (so every machine that runs it has them), each over 16k tokens.
LONG_SOURCES = ("rich.console", "pydantic.main", "fastapi.routing")
