"""Model references by name and the GGUF file a reference picks (no network)."""

from __future__ import annotations

import pytest

from tokenmill.hub.refs import HubRef, available_quants, parse_hub_ref, pick_gguf, quant_label

FILES = ["README.md", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q8_0.gguf", "m.F16.gguf",
         "mmproj-m-F16.gguf", "big/m-Q2_K-00001-of-00002.gguf", "big/m-Q2_K-00002-of-00002.gguf"]


@pytest.mark.parametrize(("text", "ref"), [
    ("org/name", HubRef("org/name")),
    ("org/name:q4_k_m", HubRef("org/name", quant="q4_k_m")),
    ("org/name@v1.0", HubRef("org/name", revision="v1.0")),
    ("org/name:Q8_0@main", HubRef("org/name", "main", "Q8_0")),
    ("org/name@abc123:Q8_0", HubRef("org/name", "abc123", "Q8_0")),
    ("org/name/file-Q8_0.gguf", HubRef("org/name", filename="file-Q8_0.gguf")),
])
def test_references_parse(text: str, ref: HubRef) -> None:
    assert parse_hub_ref(text) == ref
    assert parse_hub_ref(str(ref)) == ref


@pytest.mark.parametrize("text", ["model.gguf", "./org/name", "/abs/org/name", "~/org/name",
                                  "a/b/c", "a/b/c.bin", "org/", "/name", "org/na me",
                                  "org/name@", "llama-3.1-8b", "org--x/name", "org/a..b"])
def test_paths_and_presets_are_not_references(text: str) -> None:
    assert parse_hub_ref(text) is None


def test_revision_option_and_its_conflict() -> None:
    assert parse_hub_ref("org/name", revision="v2") == HubRef("org/name", revision="v2")
    assert parse_hub_ref("org/name@v2", revision="v2") == HubRef("org/name", revision="v2")
    with pytest.raises(ValueError, match="--revision"):
        parse_hub_ref("org/name@v1", revision="v2")
    with pytest.raises(ValueError, match="not both"):
        parse_hub_ref("org/name/f.gguf:Q8_0")
    assert HubRef("org/name", "v1", "Q8_0").name == "org/name:Q8_0"


def test_quant_labels() -> None:
    assert quant_label("m-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_label("SmolLM2-135M-Instruct.q4_1.gguf") == "Q4_1"
    assert quant_label("big/m-Q2_K-00001-of-00002.gguf") == "Q2_K"
    assert quant_label("m-UD-IQ4_XS.gguf") == "IQ4_XS"
    assert quant_label("model.gguf") is None
    assert available_quants(FILES) == ["F16", "Q2_K", "Q4_K_M", "Q4_K_S", "Q8_0"]


def test_pick_defaults_to_q4_k_m_then_the_preference_list() -> None:
    assert pick_gguf(HubRef("o/n"), FILES) == ["m-Q4_K_M.gguf"]
    assert pick_gguf(HubRef("o/n"), [f for f in FILES if "Q4" not in f]) == ["m-Q8_0.gguf"]
    assert pick_gguf(HubRef("o/n"), ["x.gguf", "a.gguf"]) == ["a.gguf"]


def test_pick_by_quant_case_insensitive_and_exact_first() -> None:
    assert pick_gguf(HubRef("o/n", quant="q8_0"), FILES) == ["m-Q8_0.gguf"]
    # Q4_K is in both Q4_K_M and Q4_K_S: the preference list decides.
    assert pick_gguf(HubRef("o/n", quant="Q4_K"), FILES) == ["m-Q4_K_M.gguf"]
    assert pick_gguf(HubRef("o/n", quant="f16"), FILES) == ["m.F16.gguf"]  # not the mmproj


def test_split_files_come_whole() -> None:
    assert pick_gguf(HubRef("o/n", quant="Q2_K"), FILES) == [
        "big/m-Q2_K-00001-of-00002.gguf", "big/m-Q2_K-00002-of-00002.gguf"]


def test_a_missing_quant_lists_the_ones_there_are() -> None:
    with pytest.raises(ValueError, match=r"no Q5_K_M GGUF file; it has: F16, Q2_K, Q4_K_M, "
                                         r"Q4_K_S, Q8_0"):
        pick_gguf(HubRef("o/n", quant="Q5_K_M"), FILES)
    with pytest.raises(ValueError, match="no file 'x.gguf'"):
        pick_gguf(HubRef("o/n", filename="x.gguf"), FILES)
    with pytest.raises(ValueError, match="no GGUF files"):
        pick_gguf(HubRef("o/n"), ["README.md"])
