"""The docs site's generated parts (docs/hooks.py): the configuration reference, the error list, README's
commands and the links to repository files, checked without running MkDocs.

The error list is checked against the real thing: a message the runtime raises must match one of the listed
templates, with each run-time part as a wildcard.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest
from mkdocs.exceptions import PluginError

from monarch_plugin import ConfigError, ElasticConfig

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def _load_hooks():
    spec = importlib.util.spec_from_file_location("monarch_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


hooks = _load_hooks()


def _pattern(template: str) -> re.Pattern:
    """A listed message as a regex: `<expr>` any text, `{a | b}` one of them, `[x]` x or nothing."""
    out = []
    for token in re.split(r"(<[^<>]*>|\{[^{}]*\}|\[[^\[\]]*\])", template):
        if token.startswith("<") and token.endswith(">"):
            out.append(".+?")
        elif token.startswith("{") and token.endswith("}"):
            out.append("(?:" + "|".join(re.escape(a) for a in token[1:-1].split(" | ")) + ")")
        elif token.startswith("[") and token.endswith("]"):
            out.append("(?:" + re.escape(token[1:-1]) + ")?")
        else:
            out.append(re.escape(token))
    return re.compile("".join(out))


def test_reference_has_every_setting_and_each_front_ends_spelling():
    page = hooks.config_reference()
    for f in dataclasses.fields(ElasticConfig):
        assert f"### `{f.name}`" in page, f.name
        assert f"[`{f.name}`](#{f.name})" in page, f.name  # in the overview table too
    section = page[page.index("### `min_replicas`"):page.index("### `max_replicas`")]
    assert "`--min-replicas MIN_REPLICAS`" in section and "| Lightning | `min_replicas` |" in section
    assert "`--monarch.min_replicas`" in section
    backend = page[page.index("### `backend`"):page.index("### `batch_policy`")]
    assert "`--backend {auto,gloo,nccl}`" in backend and "| Lightning | `backend` |" in backend
    assert "`--monarch.backend`" in backend
    heal = page[page.index("### `heal_donors`"):page.index("### `forkserver`")]
    assert "| Lightning | `heal_donors` |" in heal and "`--monarch.heal_donors`" in heal  # every one, everywhere
    steps = page[page.index("### `checkpoint_steps`"):page.index("### `checkpoint_interval_s`")]
    assert "| Lightning | not taken: `ElasticLoop`'s own" in steps
    assert "### `--monarch.enable`" in page  # torchtitan's own setting


@pytest.fixture(scope="module")
def config_errors() -> list[str]:
    """The ConfigError templates the troubleshooting page lists (reading the code takes a second)."""
    return [m.text for m in hooks.error_messages() if m.kind == "ConfigError" and not m.passed_on]


@pytest.mark.parametrize("kwargs", [
    dict(replicas=2, min_replicas=3, max_replicas=2),
    dict(replicas=0),
    dict(replicas=4, max_replicas=3),
    dict(backend="mpi"),
    dict(collective_timeout_s=0),
    dict(hosts=["10.0.0.2:26600"]),
    dict(store_host="0.0.0.0"),
    dict(token_file="token"),
    dict(fault="explode:step=3"),
    dict(sync_every=0),
    dict(semi_sync="streaming"),
    dict(sync_every=2, procs_per_replica=2),
])
def test_each_raised_config_error_is_listed(kwargs, config_errors):
    with pytest.raises(ConfigError) as raised:
        ElasticConfig(**kwargs)
    message = str(raised.value).removeprefix("`fault`: ")  # the fault parser's message, passed on
    assert any(_pattern(t).fullmatch(message) for t in config_errors), message


def test_troubleshooting_page_names_where_each_message_comes_from():
    page = hooks.troubleshooting()
    assert ("`min_replicas` (<min_replicas>) is larger than `max_replicas` (<max_replicas>): lower `min_replicas` "
            "or raise `max_replicas`") in page
    assert "### `monarch_plugin/config.py`" in page and "in `ElasticConfig.validate`" in page
    assert "`monarch-run: error: <_spelled(e)>`" in page  # cli.py's prefix, among the messages passed on
    assert "GenerationChanged" in page.split("### ")[0]  # named as not listed, with why


def test_messages_are_put_together_from_their_pieces(tmp_path):
    (tmp_path / "integrations").mkdir()
    (tmp_path / "monarch_plugin").mkdir()
    (tmp_path / "monarch_plugin" / "m.py").write_text(
        "import sys\n"
        "MODES = ('a', 'b')\n"
        "def check(x, mode):\n"
        "    if x:\n"
        "        raise ValueError('first ' + f'second {x} ' 'third: ' f\"choose one of {', '.join(MODES)}\")\n"
        "    for name in ('lo', 'hi'):\n"
        "        raise ConfigError(f'`{name}` is wrong')\n"
        "def _fail(why):\n"
        "    print(f'monarch: {why}; stopping now', file=sys.stderr)\n"
        "def run():\n"
        "    _fail('the host was declared lost by the controller')\n"
        "    _fail('no contact with the controller for a long time')\n"
        "    try:\n"
        "        pass\n"
        "    except ConfigError as e:\n"
        "        raise RuntimeError(f'prefix: {e}') from e\n"
    )
    texts = {(m.kind, m.text, m.passed_on) for m in hooks.error_messages(tmp_path)}
    assert texts == {
        ("ValueError", "first second <x> third: choose one of a, b", False),
        ("ConfigError", "`{lo | hi}` is wrong", False),
        ("stderr", "monarch: the host was declared lost by the controller; stopping now", False),
        ("stderr", "monarch: no contact with the controller for a long time; stopping now", False),
        ("RuntimeError", "prefix: <e>", True),
    }
    (tmp_path / "monarch_plugin" / "m.py").write_text("def f():\n    raise WeirdError('something went wrong')\n")
    with pytest.raises(PluginError, match="add it to USER_FACING"):
        hooks.error_messages(tmp_path)


def test_quickstart_shows_readmes_two_commands_verbatim():
    readme = (ROOT / "README.md").read_text()
    commands = hooks.readme_commands(readme)
    blocks = re.findall(r"```bash\n(.*?)\n```", commands, re.S)
    assert len(blocks) == 2 and "monarch-run" in blocks[0] and "pytest" in blocks[1]
    assert all(block in readme for block in blocks)
    with pytest.raises(PluginError, match="two ```bash blocks"):
        hooks.readme_commands("# no commands here\n")


def test_links_to_repository_files_leave_docs_only_for_files_that_exist():
    page = ("See [the recipe](../recipes/elastic_loop.py), [`README.md`](../README.md#run-it), "
            "[a page](runtime.md#events) and [a site](https://example.org).\n"
            "```\n[not a link](../nowhere.py)\n```\n")
    linked = hooks.repo_links(page, "index.md", "https://src.example/blob/main/")
    assert "[the recipe](https://src.example/blob/main/recipes/elastic_loop.py)" in linked
    assert "[`README.md`](https://src.example/blob/main/README.md#run-it)" in linked
    assert "[a page](runtime.md#events)" in linked and "[a site](https://example.org)" in linked
    assert "[not a link](../nowhere.py)" in linked  # fenced code is left alone
    plain = hooks.repo_links(page, "index.md", None)
    assert "the recipe (`recipes/elastic_loop.py`)" in plain and "`README.md`, [a page]" in plain
    with pytest.raises(PluginError, match="no file of the repository"):
        hooks.repo_links("[gone](../tests/no_such_file.py)", "index.md", None)


def test_a_generated_page_without_its_marker_fails():
    assert "<!-- generated" not in hooks.fill_markers("# Reference\n\n<!-- generated: config-reference -->\n",
                                                      "reference.md")
    with pytest.raises(PluginError, match=r"\['config-reference'\]"):
        hooks.fill_markers("# Reference, its marker lost\n", "reference.md")
    with pytest.raises(PluginError, match=r"\['error-messages'\]"):
        hooks.fill_markers("<!-- generated: error-messages -->", "index.md")
