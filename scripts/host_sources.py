"""The package sources this machine uses, handed to an image build (`make image`).

An image build should install from exactly the registries the host installs from, and from no
others: here that is pip's configuration (a local wheel directory and two file:// indexes next
to PyPI, behind a proxy whose CA is in the host's certificate bundle) and apt's sources list.

    python3 scripts/host_sources.py OUT_DIR

writes OUT_DIR/pip.conf, the host's effective pip settings in one file, and prints one buildah
`--volume` argument per line: that file as the build's /etc/pip.conf, every local path the
settings name (read-only, at the same path), and the host's apt sources over the image's own.
Environment variables (PIP_FIND_LINKS, ...) count, and win over the files, as they do for pip.
"""

from __future__ import annotations

import ast
import configparser
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

__all__ = ["pip_settings", "local_paths", "apt_sources", "volumes"]

APT = Path("/etc/apt")


def pip_settings(listing: str) -> dict[str, dict[str, str]]:
    """Section -> key -> value from `pip config list`, the way pip merges them.

    pip prints `section.key='value'` per file setting and `:env:.key='value'` per PIP_*
    variable; a variable overrides the same key in any file, so it lands in [global] last.
    Raises ValueError on a line of any other shape."""
    settings: dict[str, dict[str, str]] = {}
    env: dict[str, str] = {}
    for line in listing.splitlines():
        if not line.strip():
            continue
        name, sep, raw = line.partition("=")
        section, dot, key = name.rpartition(".")
        if not (sep and dot and section):
            raise ValueError(f"unexpected line from `pip config list`: {line!r}")
        value = ast.literal_eval(raw)
        if key == "config-file":
            continue  # PIP_CONFIG_FILE: pip lists that file's settings; they are what counts
        if section == ":env:":
            env[key] = value
        else:
            settings.setdefault(section, {})[key] = value
    for section_settings in settings.values():
        for key in env:
            section_settings.pop(key, None)
    settings.setdefault("global", {}).update(env)
    return settings


def local_paths(settings: dict[str, dict[str, str]]) -> list[Path]:
    """The host paths the settings point at, outermost only.

    A file:// index is a `simple/` directory whose pages link to files beside it (`../files/`
    here), so its parent directory goes in whole."""
    found: set[Path] = set()
    for section in settings.values():
        for value in section.values():
            for word in value.split():
                if word.startswith("file:"):
                    path = Path(unquote(urlparse(word).path)).parent
                elif word.startswith("/"):
                    path = Path(word)
                else:
                    continue
                if not path.exists():
                    raise FileNotFoundError(f"pip's configuration names {word}, which does not "
                                            "exist on this machine; fix or remove that setting")
                found.add(path)
    return sorted(p for p in found if not any(q in p.parents for q in found))


def apt_sources(apt: Path = APT) -> list[Path]:
    """What apt reads its sources from on this machine: sources.list.d (the whole directory, so
    that it hides the image's own) and sources.list where there is one."""
    paths = [p for p in (apt / "sources.list.d", apt / "sources.list") if p.exists()]
    if not paths:
        raise FileNotFoundError(f"no apt sources in {apt}")
    return paths


def volumes(pip_conf: Path, settings: dict[str, dict[str, str]], apt: Path = APT) -> list[str]:
    """buildah --volume arguments, read-only: the merged pip.conf, its paths, apt's sources."""
    pairs = [(pip_conf, Path("/etc/pip.conf"))]
    pairs += [(p, p) for p in local_paths(settings)]
    pairs += [(p, p) for p in apt_sources(apt)]
    return [f"{src.resolve()}:{dst}:ro" for src, dst in pairs]


def write_pip_conf(settings: dict[str, dict[str, str]], path: Path) -> None:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_dict(settings)
    with path.open("w") as f:
        f.write("# The host's pip settings (scripts/host_sources.py), mounted into image builds.\n")
        parser.write(f)


def main(out_dir: str) -> None:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], check=True,
                             capture_output=True, text=True).stdout
    settings = pip_settings(listing)
    pip_conf = Path(out_dir) / "pip.conf"
    write_pip_conf(settings, pip_conf)
    print("\n".join(volumes(pip_conf, settings)))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR")
    main(sys.argv[1])
