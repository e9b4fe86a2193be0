#| eval: false
import glob, os, subprocess, sys
from packaging.version import Version

TINY_LM = "tiny_lm[cloud] @ git+https://github.com/tiny-lm/tiny_lm"  # what this cell installs: the main branch
JAX_MIN = "0.10"  # tiny_lm needs jax>=0.10; an installed JAX this new that sees the accelerator is kept
# The JAX build for each runtime, named: without the extra, JAX silently runs on the CPU. cuda12 runs on
# every NVIDIA driver from 525 on; cuda13 would need 580 or newer, which a Colab GPU may not have.
JAX_BUILDS = {"tpu": "jax[tpu]", "gpu": "jax[cuda12]", "cpu": "jax"}
TPU_CHIPS = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}  # TPU v2-7x PCI ids (JAX's list)

def runtime(root="/"):
    "'tpu', 'gpu' or 'cpu': the accelerator of this machine, looked for where JAX itself looks."
    def found(pattern): return glob.glob(os.path.join(root, pattern))
    def read(path): return open(path).read().strip()
    google = [os.path.dirname(v) for v in found("sys/bus/pci/devices/*/vendor") if read(v) == "0x1ae0"]
    if any(read(f"{device}/device") in TPU_CHIPS for device in google):  # Google also makes network cards and disks
        return "tpu"
    if found("dev/accel*") or [group for group in found("dev/vfio/*") if os.path.basename(group).isdigit()]:
        return "tpu"  # the chips as older TPU VMs show them, and as libtpu reaches them through VFIO
    return "gpu" if found("proc/driver/nvidia/version") or found("dev/nvidia0") else "cpu"

def installed_jax():
    "(version, backend) of the JAX this session runs or would import; None if there is none that imports."
    if "jax" in sys.modules:  # imported here already: ask it, as another process would not get its TPU
        return sys.modules["jax"].__version__, sys.modules["jax"].default_backend()
    # asked in another process, so that this session does not import a JAX that may be about to be replaced
    query = subprocess.run([sys.executable, "-c", "import jax; print(jax.__version__, jax.default_backend())"],
                           capture_output=True, text=True)
    return tuple(query.stdout.split()[-2:]) if query.returncode == 0 else None

def fits(device, jax):
    "Whether the installed `jax`, (version, backend), is new enough and sees `device`."
    return jax is not None and Version(jax[0]) >= Version(JAX_MIN) and jax[1] == device

def plan(device, jax):
    "pip's arguments: the newest tiny_lm, with the installed JAX kept where it fits, else the build for `device`."
    # JAX named in the same call: tiny_lm's dependencies (flax) can then neither move it nor drop its extra
    keep_or_build = f"jax=={jax[0]}" if fits(device, jax) else f"{JAX_BUILDS[device]}>={JAX_MIN}"
    return ["install", "-q", "-U", keep_or_build, TINY_LM]

def set_up(root="/"):
    "Install what this runtime lacks; say what was decided, and whether the session must restart."
    device, jax = runtime(root), installed_jax()
    print(f"Runtime: {device}. Installed JAX: {' on '.join(jax) if jax else 'none that imports'}.")
    kept, args = fits(device, jax), plan(device, jax)
    print("pip", *args)
    subprocess.check_call([sys.executable, "-m", "pip", *args])
    if not kept and "jax" in sys.modules:  # this session still runs the JAX it imported before the install
        print("RESTART NEEDED: JAX was replaced after this session imported it. "
              "Runtime → Restart session, then run this cell again (it will keep the new JAX).")
        return
    jax = jax if kept else installed_jax()  # the new JAX, asked what it sees
    if jax is None or jax[1] != device:
        raise RuntimeError(f"The new JAX sees {jax[1] if jax else 'nothing'}, not the {device}: "
                           "Runtime → Restart session, then run this cell again.")
    print(f"Ready: JAX {jax[0]} ({'kept: new enough' if kept else 'installed'}) sees the {device}.")

if "google.colab" in sys.modules:  # Colab only: elsewhere, install with the README's commands
    set_up()
