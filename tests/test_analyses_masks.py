"""find_nonfinite and value_ranges pass over an infinity the program writes on purpose (a -inf
attention mask) and report where a value really went out of range."""

import jax
import jax.numpy as jnp
import numpy as np

import jamp
from tests import source_lines
from tests.source_lines import file_and_line

F16 = jamp.Policy(jnp.float16)
CAUSAL = np.tril(np.ones((4, 4), bool))
# Built on the host and put with jax.device_put, which compiles nothing (eager jnp operations, and
# jnp.asarray of a numpy array, compile a program per shape and dtype).
Q = jax.device_put(np.full((4, 8), 0.1, np.float32))
SMALL_V = jax.device_put(np.ones((4, 8), np.float32))
LARGE_V = jax.device_put(np.full((4, 8), 1000.0, np.float32))   # x 100: 1e5 overflows float16


def line_of(marker: str) -> int:
    return source_lines.line_of(__file__, marker)


def here(marker: str) -> tuple[str, int]:
    return source_lines.here(__file__, marker)


def where_masked(q, k, v):
    s = jnp.where(CAUSAL, q @ k.T, -jnp.inf)              # the usual causal mask
    return jnp.mean(jax.nn.softmax(s, axis=-1) @ (v * 100.0))  # where-overflow


def softmax_masked(q, k, v):
    p = jax.nn.softmax(q @ k.T, axis=-1, where=CAUSAL)      # JAX's own masked softmax
    return jnp.mean(p @ (v * 100.0))  # softmax-overflow


NEG_INF = jnp.full((4, 4), -jnp.inf)


def constant_masked(q, k, v):
    s = jnp.where(CAUSAL, q @ k.T, NEG_INF)                 # a closed-over -inf array
    return jnp.mean(jax.nn.softmax(s, axis=-1) @ (v * 100.0))  # constant-overflow


def scanned_mask(q, k, v):
    def step(total, _):
        s = jnp.where(CAUSAL, q @ k.T, -jnp.inf)
        return total + jax.nn.softmax(s, axis=-1) @ (v * 100.0), None  # scan-overflow
    return jnp.mean(jax.lax.scan(step, jnp.zeros((4, 8)), None, length=3)[0])


MASKED = [(where_masked, "where-overflow"), (softmax_masked, "softmax-overflow"),
          (constant_masked, "constant-overflow"), (scanned_mask, "scan-overflow")]


def test_a_masked_program_whose_values_stay_in_range_reports_nothing():
    for fn, _ in MASKED:
        assert np.isfinite(jamp.autocast_transform(fn, F16)(Q, Q, SMALL_V))
        assert jamp.find_nonfinite(fn, Q, Q, SMALL_V, policy=F16) is None, fn.__name__
    for fn in (where_masked, softmax_masked):                  # and their backward passes
        assert jamp.find_nonfinite(fn, Q, Q, SMALL_V, policy=F16, grad=True) is None


def test_the_overflow_beside_a_mask_is_found_and_its_remedy_removes_it():
    for fn, marker in MASKED:
        assert np.isfinite(jax.jit(fn)(Q, Q, LARGE_V))                        # float32: fine
        assert not np.isfinite(jamp.autocast_transform(fn, F16)(Q, Q, LARGE_V))

        found = jamp.find_nonfinite(fn, Q, Q, LARGE_V, policy=F16)

        assert file_and_line(found.source) == here(marker), (fn.__name__, str(found))
        assert found.dtype == "float16" and found.output[0].inf > 0
        assert found.operands[0].inf == 0 and found.float32_finite is True
        assert found.remedy is not None, str(found)
        remedied = jamp.autocast_transform(fn, found.remedy.policy)
        assert np.isfinite(remedied(Q, Q, LARGE_V))
        assert jamp.find_nonfinite(fn, Q, Q, LARGE_V, policy=found.remedy.policy) is None


def test_an_overflow_in_the_masked_array_itself_is_found_element_by_element():
    def scaled_after_masking(q, k):
        s = jnp.where(CAUSAL, q @ k.T, -jnp.inf)
        return jnp.sum(jax.nn.softmax(s * 1000.0, axis=-1))  # scaled-mask

    q = jax.device_put(np.full((4, 8), 3.0, np.float32))      # 72 * 1000 overflows float16
    found = jamp.find_nonfinite(scaled_after_masking, q, q, policy=F16)
    assert found.primitive == "mul" and file_and_line(found.source) == here("scaled-mask")
    assert found.operands[0].inf == 6                         # the mask, passed on
    assert found.output[0].inf == 16                          # and the 10 new infinities


def test_a_fully_masked_row_is_a_nan_and_is_reported():
    def no_keys_for_row_0(q):
        s = jnp.where(CAUSAL & (np.arange(4) > 0)[:, None], q @ q.T, -jnp.inf)
        return jnp.sum(jax.nn.softmax(s, axis=-1))
    found = jamp.find_nonfinite(no_keys_for_row_0, Q)
    assert found.primitive == "sub"                           # -inf - (-inf)
    assert found.output[0].nan == 4 and found.operands[0].inf > 0


def test_a_function_returning_minus_inf_on_purpose_reports_nothing():
    def largest_above(x, threshold):
        return 2.0 * jnp.max(jnp.where(x > threshold, x, -jnp.inf))   # -inf: none above it
    assert jax.jit(largest_above)(Q, 100.0) == -np.inf
    assert jamp.find_nonfinite(largest_above, Q, 100.0, policy=F16) is None


def test_value_ranges_lists_no_overflow_for_a_mask_and_the_real_one_beside_it():
    masked = jamp.value_ranges(where_masked, Q, Q, SMALL_V)
    assert masked.overflows == []
    selected = [e for e in masked.entries if e.primitive == "select_n"]
    assert selected and all(0 < e.max_abs < np.inf for e in selected)

    overflowing = jamp.value_ranges(where_masked, Q, Q, LARGE_V, policy=F16)
    assert [file_and_line(e.source) for e in overflowing.overflows] == [here("where-overflow")]
