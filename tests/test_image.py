"""`make image`'s helpers, without building anything (the build itself takes minutes and runs
as `make image`, outside `make test`; docker/README.md).

- scripts/host_sources.py hands the build the host's pip settings: pip reads the file it writes
  back to the same settings, and every local path they name is mounted.
- scripts/image.sh resolves image names as Docker does, and its demo is the README's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import host_sources  # noqa: E402

IMAGE_SH = ROOT / "scripts" / "image.sh"


def pip_listing(env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-m", "pip", "config", "list"], env=env, check=True,
                          capture_output=True, text=True).stdout


def test_pip_settings_merge_like_pip():
    listing = ("global.find-links='/a'\n"
               "global.timeout='60'\n"
               "install.timeout='90'\n"
               ":env:.timeout='180'\n"
               ":env:.config-file='/etc/other.conf'\n"
               ":env:.extra-index-url='file:///x/simple file:///y/simple'\n")
    assert host_sources.pip_settings(listing) == {
        "global": {"find-links": "/a", "timeout": "180",
                   "extra-index-url": "file:///x/simple file:///y/simple"},
        "install": {}}
    with pytest.raises(ValueError, match="unexpected line"):
        host_sources.pip_settings("timeout=1\n")


def test_written_pip_conf_reads_back_as_the_same_settings(tmp_path):
    """The file mounted as the build's /etc/pip.conf: pip, given only that file and the host's
    /etc files it cannot avoid, must arrive at the settings the host's pip has now."""
    host = host_sources.pip_settings(pip_listing(dict(os.environ)))
    conf = tmp_path / "pip.conf"
    host_sources.write_pip_conf(host, conf)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "none"),
               PIP_CONFIG_FILE=str(conf))
    back = host_sources.pip_settings(pip_listing(env))
    assert {k: v for k, v in back.items() if v} == {k: v for k, v in host.items() if v}


def test_local_paths_mount_index_roots_and_outermost_paths(tmp_path):
    (tmp_path / "pypi" / "simple").mkdir(parents=True)
    (tmp_path / "pypi" / "files").mkdir()
    (tmp_path / "wheels" / "sub").mkdir(parents=True)
    settings = {"global": {
        "extra-index-url": f"file://{tmp_path}/pypi/simple https://pypi.example/simple",
        "find-links": f"{tmp_path}/wheels {tmp_path}/wheels/sub",
        "timeout": "60"}}
    assert host_sources.local_paths(settings) == [tmp_path / "pypi", tmp_path / "wheels"]
    settings["global"]["cert"] = str(tmp_path / "missing.pem")
    with pytest.raises(FileNotFoundError, match="missing.pem"):
        host_sources.local_paths(settings)


def test_volumes_are_read_only_and_hide_the_image_apt_sources(tmp_path):
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    conf = tmp_path / "pip.conf"
    conf.write_text("")
    vols = host_sources.volumes(conf, {"global": {"find-links": str(tmp_path)}}, apt)
    assert vols == [f"{conf}:/etc/pip.conf:ro", f"{tmp_path}:{tmp_path}:ro",
                    f"{apt}/sources.list.d:{apt}/sources.list.d:ro"]
    with pytest.raises(FileNotFoundError, match="no apt sources"):
        host_sources.volumes(conf, {}, tmp_path / "empty")


def image_sh(snippet: str) -> str:
    return subprocess.run(["bash", "-c", f'source "{IMAGE_SH}"; {snippet}'], check=True,
                          capture_output=True, text=True).stdout


@pytest.mark.parametrize("name, ref", [
    ("python:3.11-slim-bookworm", "docker.io/library/python:3.11-slim-bookworm"),
    ("nvidia/cuda:12.8.1-devel-ubuntu24.04", "docker.io/nvidia/cuda:12.8.1-devel-ubuntu24.04"),
    ("ghcr.io/org/img:1", "ghcr.io/org/img:1"),
    ("localhost:5000/img", "localhost:5000/img"),
    ("localhost/hvd_gqsgd-base:bookworm-debian", "localhost/hvd_gqsgd-base:bookworm-debian"),
])
def test_image_names_resolve_as_docker_resolves_them(name, ref):
    assert image_sh(f"qualify {name}") == ref + "\n"


def makefile_var(name: str) -> str:
    (value,) = re.findall(rf"^{name} \?= (.*)$", (ROOT / "Makefile").read_text(), re.M)
    return value


def test_image_demo_is_the_documented_docker_run():
    """make image runs the demo a user is told to run: README's `docker run` line, the image's
    own usage hint (docker/usage.sh), and image.sh's default."""
    demo = makefile_var("IMAGE_DEMO")
    readme = (ROOT / "README.md").read_text()
    assert f"\ndocker run --rm hvd_gqsgd {demo}\n" in readme
    usage = (ROOT / "docker" / "usage.sh").read_text()
    assert re.sub(r"^horovodrun", "$run horovodrun", demo) in usage
    assert image_sh('printf %s "$DEMO"') == demo
    script = demo.split()[demo.split().index("python") + 1]
    assert (ROOT / script).is_file()


def test_image_store_is_one_documented_place():
    store = makefile_var("IMAGE_STORE")
    assert image_sh('printf %s "$STORE"') == store
    assert not store.startswith(str(ROOT)) and store.startswith("/var/tmp/")
    assert store in (ROOT / "docker" / "README.md").read_text()
    assert image_sh('printf %s "$TMPDIR"') == f"{store}/tmp"


def test_image_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(IMAGE_SH)], check=True)
