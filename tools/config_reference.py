"""Generate the `HybridAttentionConfig` reference table of docs/user_guide.md from the dataclass.

    python tools/config_reference.py           # print the table
    python tools/config_reference.py --write   # rewrite it in docs/user_guide.md

Names, types, defaults and sections come from the dataclass and its source (the `# Section.`
comment lines and each field's trailing comment); the Megatron column from the integration's
field translation. tests/test_docs_examples_configs.py fails when the guide is out of date.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron_dsa.config import HybridAttentionConfig  # noqa: E402
from megatron_dsa.integrations.megatron_config import DSV4_FIELDS, NOT_OVERRIDABLE, SHARED_FIELDS  # noqa: E402

GUIDE = REPO_ROOT / "docs" / "user_guide.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
_SECTION = re.compile(r"^    # (?P<title>.+?)\.?$")
_FIELD = re.compile(r"^    (?P<name>\w+): (?P<type>[^=]+?) = [^#]+?(?:#\s*(?P<comment>.*))?$")
# Meanings of fields whose source line has no trailing comment.
_MEANINGS = {
    "num_layers": "attention layers in the stack (the pattern has one symbol per layer)",
    "qk_layernorm": "RMSNorm with a gain on the q latent and on kv (else Identity, no parameter)",
    "layernorm_epsilon": "eps of every RMSNorm, including the per-head q norm",
    "qk_head_dim": "M only: un-rotated q/k head dim (None = D − P)",
    "kv_lora_rank": "M only: kv latent rank (None = D − P)",
    "hca_compress_ratio": "r of H layers (>= 8)",
    "rotary_base": "plain RoPE base (W layers; M with rope_type 'rope')",
    "rotary_percent": "share of the P dims a plain table covers",
    "csa_compress_rotary_base": "YaRN base of C and H layers",
    "rotary_scaling_factor": "YaRN factor s",
    "original_max_position_embeddings": "YaRN L0",
    "beta_fast": "YaRN ramp start", "beta_slow": "YaRN ramp end",
    "mscale_all_dim": "M only: YaRN softmax-scale magnitude",
    "dsa_indexer_loss_coeff": "weight of the indexer KL loss (0 = no loss, indexer grads exactly 0)",
    "dsa_indexer_use_sparse_loss": "KL over the top-k (True) or over all visible entries",
    "calculate_per_token_loss": "KL summed over tokens instead of averaged",
    "init_method_std": "N(0, std) init; output projection std / sqrt(2·num_layers)",
    "add_bias_linear": "must stay False (no biases)",
    "recompute_attention": "recompute the attention in backward; only the input rows are kept",
}
_MEGATRON_RENAMED = {"layer_pattern": "`csa_compress_ratios` (dev; 0→W, 4→C, ≥8→H)",
                     "hca_compress_ratio": "the H ratio in `csa_compress_ratios` (dev)",
                     "cp_partition": "`cp_partition_mode` (where present)",
                     "cp_comm_type": "`cp_comm_type` (`allgather` → `all_gather`)",
                     "attention_backend": "`attention_backend` (enum: local/unfused → unfused, others → auto)",
                     "add_bias_linear": "`add_bias_linear` (must be False)",
                     "recompute_attention": "on with `recompute_granularity='selective'` and `core_attn` or "
                                            "`mla_up_proj` in `recompute_modules`"}


def megatron_column(name: str) -> str:
    if name in SHARED_FIELDS:
        return f"`{name}`"
    if name in DSV4_FIELDS:
        return f"`{name}` (dev only; else an override)"
    if name in NOT_OVERRIDABLE:
        return "`set_indexer_loss_scale()`"
    return _MEGATRON_RENAMED.get(name, "— (override)")


def render() -> str:
    """The markdown reference: one table per section of the dataclass."""
    defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                for f in dataclasses.fields(HybridAttentionConfig)}
    body = inspect.getsource(HybridAttentionConfig).split("\n    def ", 1)[0].splitlines()
    out, block = [], []
    for line in body:
        section, field = _SECTION.match(line), _FIELD.match(line)
        if section and not field and not section.group("title").startswith("-"):
            block.append(section.group("title"))  # a section's comment may run over several lines
            continue
        if block:
            out += section_heading(block)
            block = []
        if field and field.group("name") in defaults:
            name = field.group("name")
            meaning = (field.group("comment") or _MEANINGS.get(name, "")).replace("|", "\\|")
            out.append(f"| `{name}` | `{field.group('type').strip()}` | `{defaults[name]!r}` | {meaning} | "
                       f"{megatron_column(name)} |")
    return "\n".join(out).strip() + "\n"


def section_heading(comment: list[str]) -> list[str]:
    """A section's comment lines → its bold title (the text before the first ':', or all of a
    one-line comment), the rest of the comment as a sentence, and the table header."""
    text = " ".join(comment)
    title, _, rest = text.partition(":") if ":" in comment[0] else (text, "", "")
    heading = ["", f"**{title.strip().rstrip('.')}**", ""]
    if rest.strip():
        sentence = rest.strip()
        heading += [sentence[0].upper() + sentence[1:] + ("" if sentence.endswith(".") else "."), ""]
    return heading + ["| field | type | default | meaning | Megatron-Core |", "|---|---|---|---|---|"]


def current_section(text: str) -> str:
    if START not in text or END not in text:
        raise ValueError(f"{GUIDE} lacks the {START} / {END} markers")
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"update {GUIDE.name} in place")
    args = parser.parse_args()
    table = render()
    if not args.write:
        print(table, end="")
        return 0
    text = GUIDE.read_text()
    current_section(text)  # checks the markers
    before, rest = text.split(START, 1)
    GUIDE.write_text(before + START + "\n" + table + END + rest.split(END, 1)[1])
    print(f"updated {GUIDE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
