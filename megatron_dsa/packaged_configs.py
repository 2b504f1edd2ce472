"""The job configs shipped with the package, and how `--config` / `--preset` name one.

The YAMLs live in the repository's `configs/`; `megatron_dsa/configs` links to it, so installed
packages carry the same files as package data. A `--config` path that exists is read as given; one
that does not exist but is a bare file name or `configs/<name>` of a packaged config (`tiny.yaml`,
`configs/tiny_cp2.yaml`) is read from the package, so the documented commands work from any
directory. A preset is a packaged config's file stem with dashes: `tiny`, `tiny-cp2`, `dsv4-flash`.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def packaged_configs() -> dict[str, Path]:
    """Preset name → packaged YAML, in name order."""
    return {path.stem.replace("_", "-"): path for path in sorted(CONFIG_DIR.glob("*.yaml"))}


def preset_config(name: str) -> Path:
    """The packaged YAML of preset `name` (`tiny_cp2` is read as `tiny-cp2`)."""
    presets = packaged_configs()
    path = presets.get(name.replace("_", "-"))
    if path is None:
        raise ValueError(f"unknown preset {name!r}; the packaged presets are {', '.join(presets)}")
    return path


def resolve_config(path: Path | str) -> Path:
    """`path` if it exists, else the packaged config it names (see the module docstring)."""
    path = Path(path)
    if path.exists():
        return path
    packaged = CONFIG_DIR / path.name
    if path.parent in (Path("."), Path("configs")) and packaged.is_file():
        return packaged
    names = ", ".join(p.name for p in packaged_configs().values())
    raise FileNotFoundError(f"config file {path} not found (relative paths start at {Path.cwd()}); "
                            f"the packaged configs, usable by name from any directory, are {names}")
