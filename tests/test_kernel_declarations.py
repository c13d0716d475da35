"""Every kernel prototype in rwkvx/cu/<family>/*.cu matches its declaration in rwkvx/cu (count, order, names,
types), every declared kernel exists and every kernel is declared; declarations bind arguments by
name and reject missing, extra and mistyped ones. No GPU or NVRTC needed."""
import re

import pytest

import rwkvx.cu  # noqa: F401  (declares every kernel file)
from rwkvx.runtime import DevPtr
from rwkvx.runtime.kernel import F32_IN, INT, X_IN, X_OUT, Arg, KernelFile
from rwkvx.runtime.nvrtc import CU_DIR

_PROTO = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:(?:__launch_bounds__|__cluster_dims__)\s*\([^)]*\)\s*)*'
                    r'(\w+)\s*\(([^)]*)\)', re.S)
_C_TYPES = {"const floatX*": X_IN, "floatX*": X_OUT}
for _elem, _c in (("bf16", "__nv_bfloat16"), ("f32", "float"), ("f64", "double"), ("i32", "int")):
    _C_TYPES[f"const {_c}*"] = Arg("ptr", _elem)
    _C_TYPES[f"{_c}*"] = Arg("ptr", _elem, const=False)
_C_TYPES.update({"int": Arg("int"), "long long": Arg("long"), "float": Arg("float"), "double": Arg("double")})


def parse_prototypes(text: str) -> dict[str, list[tuple[str, Arg]]]:
    """kernel name -> [(parameter name, type)] of every extern "C" __global__ kernel in CUDA source."""
    text = re.sub(r"//[^\n]*", "", text)
    out = {}
    for name, params in _PROTO.findall(text):
        parsed = []
        for p in (p.strip() for p in params.split(",") if p.strip()):
            p = re.sub(r"\s+", " ", p.replace("__restrict__", "")).strip()
            m = re.fullmatch(r"(.+?)\s*(\**)\s*(\w+)", p)
            assert m, f"{name}: cannot parse parameter {p!r}"
            ctype = (m.group(1).strip() + m.group(2)).replace(" *", "*")
            assert ctype in _C_TYPES, f"{name}: parameter {m.group(3)} has unsupported type {ctype!r}"
            parsed.append((m.group(3), _C_TYPES[ctype]))
        out[name] = parsed
    return out


CU_FILES = sorted(CU_DIR.glob("*/*.cu"))


def module_id(path) -> str:
    """The kernel module id of a file: "<family>/<file>"."""
    return f"{path.parent.name}/{path.stem}"


def test_every_cu_file_is_declared():
    assert {module_id(p) for p in CU_FILES} == set(KernelFile.registry)


@pytest.mark.parametrize("path", CU_FILES, ids=module_id)
def test_prototypes_match_declarations(path):
    found = parse_prototypes(path.read_text())
    declared = KernelFile.registry[module_id(path)].kernels
    assert set(found) == set(declared), (f"{path.name}: kernels without declaration "
                                         f"{sorted(set(found) - set(declared))}, declared but missing "
                                         f"{sorted(set(declared) - set(found))}")
    for name, params in found.items():
        decl = [(n, a.c_type()) for n, a in declared[name].params]
        proto = [(n, a.c_type()) for n, a in params]
        assert decl == proto, f"{path.name}: {name}\n  prototype:   {proto}\n  declaration: {decl}"


def test_no_constant_is_defined_in_cuda_that_python_passes():
    for path in CU_FILES:
        text = path.read_text()
        kf = KernelFile.registry[module_id(path)]
        for name in [*kf.constants, *kf.variants]:
            assert not re.search(rf"^\s*#\s*define\s+{name}\b", text, re.M), f"{path.name} defines {name} itself"


def test_parser_reads_a_prototype():
    src = ('extern "C" __global__ void __launch_bounds__(256, 2)\n'
           'k(const floatX* __restrict__ x, float* y, // comment\n long long n, int* idx)\n{')
    assert parse_prototypes(src) == {"k": [("x", X_IN), ("y", Arg("ptr", "f32", const=False)),
                                           ("n", Arg("long")), ("idx", Arg("ptr", "i32", const=False))]}


# ---------------------------------------------------------------- binding by name
FILE = KernelFile("decl_probe", constants={"A": 1}, variants={"N": (4, 8)})
PROBE = FILE.kernel("probe", x=X_IN, w=F32_IN, y=X_OUT.opt(), n=INT)
del KernelFile.registry["decl_probe"]     # a probe of the binding, not a file of rwkvx/cu
X = DevPtr(1 << 20, "f32")
W = DevPtr(2 << 20, "f32")


def test_launch_binds_by_name_in_declared_order():
    op = PROBE.launch((1, 1, 1), (32, 1, 1), n=5, y=None, w=W, x=X, variant={"N": 4})
    assert op.args == (("p", int(X)), ("p", int(W)), ("p", 0), ("i", 5))
    assert dict(op.defines) == {"A": "1", "N": "4", "FLOATX_BF16": "0"}


@pytest.mark.parametrize("kwargs, error", [
    (dict(w=W, y=None, n=1), TypeError),                       # x missing
    (dict(x=X, w=W, y=None, n=1, extra=1), TypeError),         # unknown argument
    (dict(x=X, w=W, y=None, n=1.5), TypeError),                # float for int
    (dict(x=X, w=W, y=None, n=True), TypeError),               # bool for int
    (dict(x=int(X), w=W, y=None, n=1), TypeError),             # untyped pointer
    (dict(x=DevPtr(X, "bf16"), w=W, y=None, n=1), TypeError),  # bf16 buffer in an f32 launch
    (dict(x=X, w=DevPtr(W, "bf16"), y=None, n=1), TypeError),  # fp32 parameter given bf16
    (dict(x=None, w=W, y=None, n=1), ValueError),              # NULL for a required buffer
    (dict(x=X, w=W, y=None, n=1 << 40), ValueError),           # does not fit int32
])
def test_launch_rejects_bad_arguments(kwargs, error):
    with pytest.raises(error):
        PROBE.launch((1, 1, 1), (32, 1, 1), variant={"N": 4}, **kwargs)


def test_floatx_follows_the_launch_element_type():
    bx = DevPtr(1 << 20, "bf16")
    op = PROBE.launch((1, 1, 1), (32, 1, 1), xtype="bf16", variant={"N": 8}, x=bx, w=W, y=bx, n=1)
    assert dict(op.defines)["FLOATX_BF16"] == "1"
    with pytest.raises(ValueError):
        PROBE.launch((1, 1, 1), (32, 1, 1), variant={"N": 16}, x=X, w=W, y=None, n=1)   # unsupported variant
    with pytest.raises(ValueError):
        PROBE.launch((1, 1, 1), (32, 1, 1), x=X, w=W, y=None, n=1)                      # variant missing


def test_compile_cases_cover_every_variant_and_element_type():
    cases = {tuple(sorted(d)) for d in FILE.compile_cases()}
    assert len(cases) == 4 and all(dict(c)["A"] == "1" for c in cases)
