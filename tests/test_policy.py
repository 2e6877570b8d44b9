"""Policy validation, immutability, repr, from_string and scope-rule matching."""
import pydoc
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp.policy import FP32, LOWER, PROMOTE, RegionState
from tests.host_data import ones


def test_defaults_follow_the_design_tables():
    policy = jamp.Policy()
    assert policy.compute_dtype == jnp.bfloat16
    assert {"dot_general", "conv_general_dilated"} <= policy.lower
    assert {"exp", "log", "reduce_sum", "cumsum", "rsqrt", "erf_inv"} <= policy.fp32
    assert {"add", "mul", "select_n", "concatenate", "dynamic_update_slice"} <= policy.promote
    assert not (LOWER & FP32 or LOWER & PROMOTE or FP32 & PROMOTE)


def test_policy_is_hashable_and_usable_as_static_jit_argument():
    a, b = jamp.Policy(jnp.float16), jamp.Policy(np.float16)
    assert a == b and hash(a) == hash(b)
    seen = []
    run = jax.jit(lambda x, p: seen.append(p) or x * 2, static_argnums=1)
    run(jnp.ones(2), a)
    run(jnp.ones(2), b)  # equal policy: no retrace
    assert seen == [a]


def test_replace_changes_fields_and_rejects_unknown_ones():
    policy = jamp.Policy().replace(compute_dtype=jnp.float16, output_dtype=jnp.float32)
    assert policy.compute_dtype == jnp.float16 and policy.output_dtype == jnp.float32
    with pytest.raises(TypeError, match="no field 'compute'"):
        jamp.Policy().replace(compute=jnp.float16)
    with pytest.raises(TypeError, match="unexpected keyword"):
        jamp.Policy(bogus=1)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64, "int8"])
def test_non_floating_compute_dtype_is_a_value_error(dtype):
    with pytest.raises(ValueError, match="compute_dtype"):
        jamp.Policy(dtype)


def test_table_overlap_and_bad_rules_are_rejected():
    with pytest.raises(ValueError, match="overlap on \\['exp'\\]"):
        jamp.Policy(lower=LOWER | {"exp"})
    with pytest.raises(TypeError, match="rules\\[0\\]"):
        jamp.Policy(rules=("Dense_0",))
    with pytest.raises(ValueError, match="rules\\[0\\]\\[1\\]"):
        jamp.Policy(rules=(("Dense_0", jnp.int32),))
    with pytest.raises(TypeError, match="set of primitive names"):
        jamp.Policy(fp32="exp")


def test_float64_is_refused_as_a_rules_or_accumulate_dtype_as_it_is_as_compute_dtype():
    """A float64 rule or accumulation passed and made float64 arrays even with jax_enable_x64
    off, which JAX itself never hands out; the message said (bfloat16, float16, float32)."""
    for kwargs, field in (({"rules": (("head", jnp.float64),)}, r"rules\[0\]\[1\]"),
                          ({"accumulate_dtype": jnp.float64}, "accumulate_dtype")):
        with pytest.raises(ValueError, match=rf"Policy\.{field} cannot be float64"):
            jamp.Policy(**kwargs)
    assert jamp.Policy(rules=(("head", jnp.float32),)).rules == (("head", jnp.float32),)


def test_category_lookup():
    policy = jamp.Policy()
    assert policy.category("dot_general") == "lower"
    assert policy.category("log") == "fp32"
    assert policy.category("add") == "promote"
    assert policy.category("tanh") is None


BF16, F16 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


def _walk(path, rules):
    state = RegionState(enabled=True, dtype=BF16)
    for name in path:
        state = state.enter_scope(name, rules)
    return state


def test_rules_innermost_scope_wins_and_later_rule_breaks_ties():
    rules = (("*", None), ("*/Dense_0", F16))
    assert not _walk(["M"], rules).enabled
    inner = _walk(["M", "Dense_0"], rules)
    assert inner.enabled and inner.dtype == F16
    tie = (("M", F16), ("M", None))
    assert not _walk(["M"], tie).enabled


def test_rule_matched_outside_does_not_reapply_deeper():
    # "Block*" also matches "Block_0/attn"; it applied at "Block_0" and must not override what
    # happened in between (here: a deeper rule disabling autocast for the attention).
    rules = (("Block*", F16), ("*/attn", None))
    state = _walk(["Block_0", "attn", "inner"], rules)
    assert not state.enabled


# --- table names are primitives of the running JAX ----------------------------------------------

@pytest.mark.parametrize("field, typo, suggestion", [
    ("lower", "dot", "dot_general"),
    ("promote", "scatter_add", "scatter-add"),
    ("fp32", "reduce_summ", "reduce_sum"),
    ("fp32", "Exp", "exp"),
])
def test_unknown_primitive_names_are_rejected_with_a_suggestion(field, typo, suggestion):
    table = {"lower": LOWER, "fp32": FP32, "promote": PROMOTE}[field]
    with pytest.raises(ValueError) as info:
        jamp.Policy(**{field: table | {typo}})
    message = str(info.value)
    assert f"Policy.{field}: {typo!r} is not a primitive" in message
    assert f"did you mean {suggestion!r}" in message
    assert jax.__version__ in message


def test_replace_checks_table_names_too():
    with pytest.raises(ValueError, match="'dot'.*'dot_general'"):
        jamp.Policy().replace(lower={"dot"})


def test_known_primitives_come_from_the_running_jax():
    from jamp import _compat as compat
    names = compat.primitive_names()
    assert {"dot_general", "scatter-add", "exp", "integer_pow", "tanh", "cumsum"} <= names
    assert "scatter_add" not in names and "dot" not in names
    # every primitive in a real program is known, e.g. the ones jnp.linalg and scans produce
    jaxpr = jax.make_jaxpr(lambda x: jax.lax.cumsum(jnp.linalg.cholesky(x @ x.T)))(
        jax.device_put(np.eye(3, dtype=np.float32)))  # (jnp.eye compiles)
    assert {str(e.primitive) for e in jaxpr.jaxpr.eqns} <= names


def test_default_tables_construct_and_valid_extensions_work():
    policy = jamp.Policy(fp32=FP32 | {"tanh", "logistic"}, promote=PROMOTE - {"pad"})
    assert {"tanh", "logistic"} <= policy.fp32 and "pad" not in policy.promote
    # a primitive of the user's own, once defined (lowering registered), is a valid name
    from jax.extend.core import Primitive
    from jax.interpreters import mlir
    my_prim = Primitive("jamp_test_my_scale")
    my_prim.def_abstract_eval(lambda x: x)
    mlir.register_lowering(my_prim, mlir.lower_fun(lambda x: x * 2, multiple_results=False))
    assert "jamp_test_my_scale" in jamp.Policy(fp32=FP32 | {"jamp_test_my_scale"}).fp32


def test_table_must_be_a_set_of_strings():
    with pytest.raises(TypeError, match="Policy.lower must be a set of primitive names"):
        jamp.Policy(lower="dot_general")
    with pytest.raises(TypeError, match="Policy.fp32 must be a set of primitive names"):
        jamp.Policy(fp32={jax.lax.exp_p})
    assert jamp.Policy(lower=(n for n in ["dot_general"])).lower == {"dot_general"}


# --- rules are validated globs ------------------------------------------------------------------

@pytest.mark.parametrize("regex, glob", [("^.*head$", "*head"), (".*head", "*head"),
                                         ("MLP/(head|out)", None), ("Dense_\\d+", None)])
def test_regex_looking_rules_are_rejected_with_the_glob_they_meant(regex, glob):
    with pytest.raises(ValueError) as info:
        jamp.Policy(rules=(("*/ok", None), (regex, None)))
    message = str(info.value)
    assert f"Policy.rules[1][0] = {regex!r} looks like a regular expression" in message
    assert "glob" in message
    if glob is not None:
        assert f"e.g. {glob!r}" in message


@pytest.mark.parametrize("rules, culprit", [
    ((("", None),), "rules[0][0]"),
    (((3, None),), "rules[0][0]"),
    ((("*/head", None), (jnp.float16, "*/x")), "rules[1][0]"),
    ((("*/head", None, 1),), "rules[0]"),
])
def test_malformed_rules_name_the_culprit(rules, culprit):
    with pytest.raises(TypeError, match=re.escape(f"Policy.{culprit}")):
        jamp.Policy(rules=rules)


def test_a_single_pair_instead_of_a_sequence_of_pairs_is_explained():
    with pytest.raises(TypeError, match=re.escape("write rules=(('*/head', None),)")):
        jamp.Policy(rules=("*/head", None))
    with pytest.raises(TypeError, match=re.escape("write rules=(('*/head', jnp.float16),)")):
        jamp.Policy(rules=("*/head", jnp.float16))
    with pytest.raises(TypeError, match=re.escape("Policy.rules[0] must be a (glob pattern")):
        jamp.Policy(rules=("Dense_0", "head"))  # two globs without dtypes: not "a single pair"
    assert jamp.Policy(rules=[["*/head", None]]).rules == (("*/head", None),)


# --- repr and help ------------------------------------------------------------------------------

def test_repr_shows_only_what_differs_from_the_defaults():
    assert repr(jamp.Policy()) == "Policy()"
    policy = jamp.Policy(jnp.float16, output_dtype=jnp.float32, cast_inputs=True,
                         fp32=FP32 - {"exp"} | {"tanh"}, lower={"dot_general"},
                         rules=(("*/head", None),))
    assert repr(policy) == (
        "Policy(jnp.float16, output_dtype=jnp.float32, cast_inputs=True, "
        "lower={'dot_general'}, fp32=FP32 - {'exp'} | {'tanh'}, rules=(('*/head', None),))")
    # the repr evaluates back to an equal policy
    namespace = {"jnp": jnp, "Policy": jamp.Policy, "LOWER": LOWER, "FP32": FP32,
                 "PROMOTE": PROMOTE}
    assert eval(repr(policy), namespace) == policy
    assert repr(jamp.Policy(lower=LOWER - {"ragged_dot_general"})) == \
        "Policy(lower=LOWER - {'ragged_dot_general'})"
    assert repr(jamp.Policy(promote=())) == "Policy(promote=set())"
    assert eval(repr(jamp.Policy(promote=())), namespace) == jamp.Policy(promote=())


def test_help_does_not_dump_the_tables():
    text = pydoc.render_doc(jamp.Policy, renderer=pydoc.plaintext)
    assert "= LOWER" in text and "= FP32" in text and "= PROMOTE" in text
    for name in ("cumlogsumexp", "select_and_gather_add", "igamma_grad_a"):
        assert name not in text
    assert "from_string" in text


# --- Policy.from_string (jmp's get_policy format) ------------------------------------------------

@pytest.mark.parametrize("spec, expected", [
    ("compute=bfloat16,output=float32", jamp.Policy(jnp.bfloat16, output_dtype=jnp.float32)),
    ("c=f16,o=full", jamp.Policy(jnp.float16, output_dtype=jnp.float32)),
    ("c=bf16", jamp.Policy(jnp.bfloat16)),  # jmp: output follows compute; jamp: outputs untouched
    (" p=f32 , c=f16 ", jamp.Policy(jnp.float16)),  # params=float32 is accepted (nothing to do)
    ("params=float32,compute=float32", jamp.Policy(jnp.float32)),
    ("compute=half", jamp.Policy(jnp.float16)),  # jmp's half: float16 off TPU
    ("bf16", jamp.Policy(jnp.bfloat16, output_dtype=jnp.bfloat16)),  # bare dtype: compute+output
    ("compute=bf16,accumulate=f32,cast_inputs=true",
     jamp.Policy(accumulate_dtype=jnp.float32, cast_inputs=True)),
    ("cast_inputs=False", jamp.Policy()),
    ("c=float8,o=f32", jamp.Policy(jnp.float8_e4m3fn, output_dtype=jnp.float32)),
    ("compute=float8_e4m3fn", jamp.Policy(jnp.float8_e4m3fn)),
])
def test_from_string_accepts_jmp_spellings(spec, expected):
    assert jamp.Policy.from_string(spec) == expected


@pytest.mark.parametrize("spec, error, culprit", [
    ("compute=bf17", ValueError, "compute='bf17' is not a dtype (did you mean 'bf16'?)"),
    ("comptue=bf16", ValueError, "unknown key 'comptue'"),
    ("comptue=bf16", ValueError, "did you mean 'compute'?"),
    ("params=bf16", ValueError, "params='bf16': jamp never casts parameters"),
    ("compute=f64", ValueError, "compute_dtype must be bfloat16, float16, float32 or float8_e4m3fn"),
    ("c=bf16,compute=f16", ValueError, "'compute' given twice"),
    ("cast_inputs=maybe", ValueError, "cast_inputs='maybe' must be true or false"),
    ("compute_float16", ValueError, "'compute_float16' is not a dtype"),  # jmp's own test case
    ("compute=bf16,", ValueError, "'' in 'compute=bf16,' is not key=value"),
    ("", ValueError, "empty policy string"),
    # float8 is a compute dtype only (it was "not a dtype (did you mean 'float64'?)")
    ("fp8", ValueError, "float8 is only a compute dtype; write 'compute=float8_e4m3fn'"),
    ("c=bf16,o=f8", ValueError, "Policy.output_dtype cannot be float8_e4m3fn"),
    ("c=float8_e5m2", ValueError, "(did you mean 'float8_e4m3fn'?)"),
])
def test_from_string_rejects_bad_keys_and_values_by_name(spec, error, culprit):
    with pytest.raises(error) as info:
        jamp.Policy.from_string(spec)
    assert culprit in str(info.value)


def test_from_string_rejects_non_strings():
    with pytest.raises(TypeError, match="expects a str, got dict"):
        jamp.Policy.from_string({"compute": "bf16"})


# --- rules that match no scope warn once and are listed by explain -------------------------------

@pytest.fixture(autouse=True)
def _fresh_warning_registry(monkeypatch):
    """Each test starts with no (function, rule) pair warned about yet."""
    monkeypatch.setattr(jamp.policy, "_warned", set())


def _mlp(x, w):
    with jax.named_scope("MLP"):
        with jax.named_scope("hidden"):
            x = jnp.tanh(x @ w)
        with jax.named_scope("head"):
            return x @ w


# Built on the host and transferred: jnp.ones compiles a program per shape.
X, W = ones(2, 4), ones(4, 4)


def _unmatched_warnings(fn, policy, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jamp.autocast_transform(fn, policy)(*args)
    return [w for w in caught if issubclass(w.category, jamp.UnmatchedRuleWarning)]


def test_a_misspelled_rule_warns_with_the_closest_scope_paths():
    def model(x, w):  # a fresh function: the warning is once per (function, rule)
        return _mlp(x, w)

    caught = _unmatched_warnings(model, jamp.Policy(rules=(("*/head", None), ("*/haed", None))),
                                 X, W)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "Policy.rules[1] ('*/haed', None) matched no scope" in message
    assert "closest scope paths seen: 'MLP/head'" in message
    assert caught[0].filename == __file__  # points at the user's call, not at jamp


def test_case_and_linen_suffix_mistakes_get_a_specific_hint():
    import flax.linen as nn

    class Head(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(x)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Head()(nn.Dense(4)(x))

    model = Model()
    variables = jax.jit(model.init)(jax.random.key(0), X)  # (eagerly: a program per operation)
    caught = _unmatched_warnings(model.apply, jamp.Policy(rules=(("*/Head", None),
                                                                 ("*/dense_0", None))),
                                 variables, X)
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2
    assert "('*/Head', None) matched no scope" in messages[0]
    assert "'*/Head*' would match 'Model/Head_0'" in messages[0]
    assert "'Model/Head_0'" in messages[0].split("closest scope paths seen: ")[1]
    assert "('*/dense_0', None) matched no scope" in messages[1]
    assert "case-sensitive: 'Model/Dense_0' differs only in case" in messages[1]


def test_a_function_without_scopes_says_so():
    def plain(x, w):
        return x @ w

    caught = _unmatched_warnings(plain, jamp.Policy(rules=(("*/head", None),)), X, W)
    assert len(caught) == 1 and "entered no scopes" in str(caught[0].message)
    # (an NNX model enters none either: the hint says how to name its code)
    assert "Flax NNX modules enter no scopes" in str(caught[0].message)


def test_the_warning_comes_once_per_function_and_rule():
    def model(x, w):
        return _mlp(x, w)

    policy = jamp.Policy(rules=(("*/haed", None),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = jamp.autocast_transform(model, policy)
        f(X, W)
        f(X, W)
        jax.jit(f)(X, W)
        jax.jit(f)(jnp.ones((3, 4)), W)  # a retrace at other shapes
    assert sum(issubclass(w.category, jamp.UnmatchedRuleWarning) for w in caught) == 1

    def other_model(x, w):
        with jax.named_scope("other"):
            return x @ w

    assert len(_unmatched_warnings(other_model, policy, X, W)) == 1


def test_rules_matching_inside_jitted_callees_and_loop_bodies_do_not_warn():
    @jax.jit
    def helper(x, w):
        with jax.named_scope("inner"):
            return x @ w

    def model(x, w):
        with jax.named_scope("outer"):
            y = helper(x, w)
        def body(c, _):
            with jax.named_scope("step"):
                return jnp.tanh(c @ w), None
        return jax.lax.scan(body, y, None, length=2)[0]

    policy = jamp.Policy(rules=(("outer/inner", jnp.float16), ("step", None)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.UnmatchedRuleWarning)
        jamp.autocast_transform(model, policy)(X, W)


def test_explain_lists_unmatched_rules_without_warning():
    policy = jamp.Policy(rules=(("*/head", None), ("*/haed", jnp.float16)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.UnmatchedRuleWarning)
        report = jamp.explain(_mlp, X, W, policy=policy)
    assert [(r.index, r.glob) for r in report.unmatched_rules] == [(1, "*/haed")]
    assert report.unmatched_rules[0].closest[0] == "MLP/head"
    assert "unmatched rule: Policy.rules[1] ('*/haed', jnp.float16) matched no scope" in str(report)
    assert jamp.explain(_mlp, X, W, policy=jamp.Policy(rules=(("*/head", None),))) \
        .unmatched_rules == ()


def test_a_parent_wildcard_on_a_top_level_scope_is_explained():
    def model(x, w):
        with jax.named_scope("head"):
            return x @ w

    caught = _unmatched_warnings(model, jamp.Policy(rules=(("*/head", None),)), X, W)
    assert "'head' would match 'head'" in str(caught[0].message)
    assert "needs a parent scope" in str(caught[0].message)


# --- rules in an unordered collection; accumulate_dtype against the compute dtype -------------


@pytest.mark.parametrize("make", [set, frozenset], ids=["set", "frozenset"])
def test_rules_in_a_set_are_refused_since_the_later_rule_wins(make):
    """A set has no order, so which of two rules matching one scope won changed with
    PYTHONHASHSEED; it is refused with the pairs written as a tuple (in a fixed order)."""
    rules = make({("head", None), ("h*", jnp.float16)})
    with pytest.raises(TypeError, match=rf"got a {make.__name__}, which has no order") as info:
        jamp.Policy(rules=rules)
    assert "rules=(('h*', jnp.float16), ('head', None)) in the order you mean" in str(info.value)
    with pytest.raises(TypeError, match="which has no order"):
        jamp.Policy().replace(rules=make({("head", None)}))
    # ordered collections of pairs keep their order: a list, a dict's items, a generator
    pairs = (("head", None), ("h*", jnp.float16))
    expected = (("head", None), ("h*", np.dtype(jnp.float16)))
    assert jamp.Policy(rules=list(pairs)).rules == expected
    assert jamp.Policy(rules=dict(pairs).items()).rules == expected
    assert jamp.Policy(rules=(p for p in pairs)).rules == expected


@pytest.mark.parametrize("compute, accumulate, lacks", [
    (jnp.float32, jnp.bfloat16, "precision"),
    (jnp.float32, jnp.float16, "precision.*range"),
    (jnp.float16, jnp.bfloat16, "precision"),
    (jnp.bfloat16, jnp.float16, "range"),
], ids=["f32-bf16", "f32-f16", "f16-bf16", "bf16-f16"])
def test_accumulate_dtype_narrower_than_the_compute_dtype_is_refused(compute, accumulate, lacks):
    """Policy(jnp.float32, accumulate_dtype=jnp.bfloat16) made every matmul output bfloat16,
    and a float16 policy accumulating in bfloat16 mixed the two 16-bit formats."""
    with pytest.raises(ValueError, match=rf"Policy\.accumulate_dtype={np.dtype(accumulate).name} "
                                         rf"must hold every value of the compute dtype "
                                         rf"{np.dtype(compute).name}, but has less {lacks}.*"
                                         r"Use accumulate_dtype=") as info:
        jamp.Policy(compute, accumulate_dtype=accumulate)
    assert ("None" if compute == jnp.float32 else "jnp.float32") in str(info.value).split("Use")[1]
    # the same through replace and from_string, which build a Policy
    with pytest.raises(ValueError, match="accumulate_dtype"):
        jamp.Policy(compute).replace(accumulate_dtype=accumulate)
    spec = f"compute={np.dtype(compute).name},accumulate={np.dtype(accumulate).name}"
    with pytest.raises(ValueError, match=rf"from_string\('{spec}'\): Policy\.accumulate_dtype"):
        jamp.Policy.from_string(spec)


@pytest.mark.parametrize("compute, accumulate", [
    (jnp.bfloat16, jnp.float32), (jnp.float16, jnp.float32), (jnp.bfloat16, jnp.bfloat16),
    (jnp.float16, jnp.float16), (jnp.float32, jnp.float32),
    (jnp.float8_e4m3fn, jnp.float32), (jnp.float8_e4m3fn, jnp.bfloat16),
    (jnp.float8_e4m3fn, jnp.float16),
])
def test_accumulate_dtype_at_least_as_wide_is_kept(compute, accumulate):
    x, w = jnp.full((4, 4), 1.0 + 2.0 ** -10), jnp.ones((4, 4))
    policy = jamp.Policy(compute, accumulate_dtype=accumulate, min_float8_flops=0)
    assert policy.accumulate_dtype == np.dtype(accumulate)
    assert jamp.autocast_transform(lambda x, w: x @ w, policy)(x, w).dtype == accumulate


def test_with_compute_dtype_drops_an_accumulation_or_reduction_the_new_dtype_refuses():
    """A nested ``dtype=`` region and find_nonfinite's float32 remedy take "this policy, in
    that dtype": a float16 accumulation under float32 (or bfloat16) compute is refused by
    ``replace``, and dropped here; one that still fits is kept."""
    f16 = jamp.Policy(jnp.float16, accumulate_dtype=jnp.float16, reduce_dtype=jnp.float32)
    with pytest.raises(ValueError, match="accumulate_dtype"):
        f16.replace(compute_dtype=jnp.float32)
    wide = f16.with_compute_dtype(jnp.float32)
    assert (wide.compute_dtype, wide.accumulate_dtype, wide.reduce_dtype) == (
        jnp.float32, None, jnp.float32)
    assert f16.with_compute_dtype(jnp.bfloat16).accumulate_dtype is None
    kept = jamp.Policy(jnp.bfloat16, accumulate_dtype=jnp.float32)
    assert kept.with_compute_dtype(jnp.float16) == jamp.Policy(jnp.float16,
                                                               accumulate_dtype=jnp.float32)


@pytest.mark.parametrize("form", ["transform", "region"])
@pytest.mark.parametrize("policy, head_dtype", [
    # a float32 head under a bfloat16 accumulation: float32, not rounded to bfloat16
    (jamp.Policy(accumulate_dtype=jnp.bfloat16, rules=(("*head*", jnp.float32),)), jnp.float32),
    # a bfloat16 head under a float16 one: bfloat16's range, not float16's
    (jamp.Policy(jnp.float16, accumulate_dtype=jnp.float16, rules=(("*head*", jnp.bfloat16),)),
     jnp.bfloat16),
    # a scope whose dtype the accumulation holds takes it
    (jamp.Policy(jnp.float16, accumulate_dtype=jnp.float32, rules=(("*head*", jnp.bfloat16),)),
     jnp.float32),
])
def test_accumulate_dtype_never_rounds_a_scope_a_rule_runs_wider(policy, head_dtype, form):
    def head(x, w):
        with jax.named_scope("head"):
            return x @ w

    x, w = jnp.full((2, 3), 1 / 3), jnp.full((3, 2), 1 / 7)
    if form == "transform":
        out = jamp.autocast_transform(head, policy)(x, w)
    else:
        with jamp.autocast(policy):
            out = head(x, w)
    assert out.dtype == head_dtype
