// CPU kernels of the loader capability (fastdl.data.PrefetchLoader): copy the tensors of one batch into a reused,
// pre-allocated host buffer (a slot of the ring; page-locked when the loader targets a GPU), and count the
// references to a slot. The ops and their contract are defined in fastdl/ops/loader.py; this file registers their
// fastdl_cpp CPU kernels. A call through torch.ops runs the kernel with the GIL released (tests/test_loader.py
// checks it), so the producer thread copies while the Python consumer runs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "checked_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace fastdl::loader {
namespace {

// Below this many bytes per thread a helper thread costs more than it saves (spawn + join is ~20-50 us; one
// core copies ~10 GB/s, i.e. 2 MiB in ~200 us).
constexpr int64_t kMinBytesPerThread = int64_t(2) << 20;
constexpr int64_t kChunkAlign = 4096;

struct Span {
    const char *src;
    char *dst;
    int64_t nbytes;
};

// Copy bytes [begin, end) of the concatenation of `spans` (`starts` holds each span's start in that stream).
void copy_range(const std::vector<Span> &spans, const std::vector<int64_t> &starts, int64_t begin, int64_t end) {
    if (begin >= end) {
        return;
    }
    auto it = std::upper_bound(starts.begin(), starts.end(), begin);
    size_t i = static_cast<size_t>(it - starts.begin()) - 1;
    while (begin < end && i < spans.size()) {
        const Span &s = spans[i];
        int64_t local = begin - starts[i];
        int64_t n = std::min(s.nbytes - local, end - begin);
        if (n > 0) {
            std::memcpy(s.dst + local, s.src + local, static_cast<size_t>(n));
            begin += n;
        }
        ++i;
    }
}

// Same rule as c10's non-overlapping-and-dense check: sorted by stride, every dim of size > 1 must continue the
// previous one exactly. Such a tensor occupies exactly numel * itemsize bytes starting at data_ptr().
bool dense(const at::Tensor &t) {
    if (t.is_contiguous()) {
        return true;
    }
    const int64_t nd = t.dim();
    std::vector<int64_t> perm(static_cast<size_t>(nd));
    for (int64_t d = 0; d < nd; ++d) {
        perm[static_cast<size_t>(d)] = d;
    }
    std::sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) { return t.stride(a) < t.stride(b); });
    int64_t expected = 1;
    for (int64_t d : perm) {
        const int64_t size = t.size(d);
        if (size == 1) {
            continue;
        }
        if (t.stride(d) != expected || __builtin_mul_overflow(expected, size, &expected)) {
            return false; // an overflowing span is no dense tensor that exists
        }
    }
    return true;
}

void loader_fill(at::TensorList src, const at::Tensor &dst, at::IntArrayRef offsets, at::IntArrayRef keep_strides,
                 int64_t num_threads) {
    TORCH_CHECK(dst.device().is_cpu(), "loader_fill: dst must be a CPU tensor, got device ", dst.device());
    TORCH_CHECK_TYPE(dst.scalar_type() == at::kByte, "loader_fill: dst must be torch.uint8, got dtype ",
                     dst.scalar_type());
    TORCH_CHECK_VALUE(dst.is_contiguous(), "loader_fill: dst must be contiguous, got strides ", dst.strides());
    TORCH_CHECK_VALUE(offsets.size() == src.size(), "loader_fill: offsets must have one entry per src tensor (",
                      src.size(), "), got ", offsets.size());
    TORCH_CHECK_VALUE(keep_strides.size() == src.size(),
                      "loader_fill: keep_strides must have one entry per src tensor (", src.size(), "), got ",
                      keep_strides.size());
    TORCH_CHECK_VALUE(num_threads >= 1, "loader_fill: num_threads must be >= 1, got ", num_threads);

    const int64_t capacity = dst.numel();
    char *base = static_cast<char *>(dst.data_ptr());
    std::vector<Span> spans;
    std::vector<size_t> strided; // sources that need an element-wise copy (not dense)
    spans.reserve(src.size());
    for (size_t i = 0; i < src.size(); ++i) {
        const at::Tensor &s = src[i];
        TORCH_CHECK(s.device().is_cpu(), "loader_fill: src[", i, "] must be a CPU tensor, got device ", s.device());
        TORCH_CHECK_TYPE(s.layout() == at::kStrided && !s.is_quantized(), "loader_fill: src[", i,
                         "] must be a strided, non-quantized tensor, got layout ", s.layout(), ", dtype ",
                         s.scalar_type());
        // An expanded src (stride 0) has numel elements but far fewer bytes of storage: numel * itemsize can exceed
        // int64, and off + nbytes can wrap around for any off near 2^63 (issue 34: a SIGSEGV): both checked.
        const int64_t itemsize = static_cast<int64_t>(s.element_size());
        const int64_t nbytes =
            checked_mul(s.numel(), itemsize, "loader_fill", "the bytes of a src tensor (numel * itemsize)");
        const int64_t off = offsets[i];
        TORCH_CHECK_VALUE(off >= 0 && off % itemsize == 0 && range_inside(off, nbytes, capacity),
                          "loader_fill: offsets[", i, "] = ", off, " with ", nbytes,
                          " bytes must be a multiple of the item size (", itemsize, ") and lie inside dst (", capacity,
                          " bytes)");
        if (nbytes == 0) {
            continue;
        }
        // A conjugate or negative view keeps its values un-negated in memory: copy it element-wise (resolves).
        const bool raw = !s.is_conj() && !s.is_neg();
        if (keep_strides[i] != 0) {
            TORCH_CHECK_VALUE(raw && dense(s), "loader_fill: keep_strides[", i,
                              "] = 1 requires a non-overlapping and dense src tensor without conj/neg bit, got sizes ",
                              s.sizes(), ", strides ", s.strides());
            spans.push_back({static_cast<const char *>(s.data_ptr()), base + off, nbytes});
        } else if (raw && s.is_contiguous()) {
            spans.push_back({static_cast<const char *>(s.data_ptr()), base + off, nbytes});
        } else {
            strided.push_back(i);
        }
    }

    // Non-dense sources: element-wise copy into a C-contiguous view of the slot, on this thread.
    for (size_t i : strided) {
        const at::Tensor &s = src[i];
        at::Tensor view = at::from_blob(base + offsets[i], s.sizes(), s.options().device(at::kCPU));
        view.copy_(s);
    }

    std::vector<int64_t> starts(spans.size());
    int64_t total = 0;
    for (size_t i = 0; i < spans.size(); ++i) { // each span fits in dst, but sources may overlap there: checked sum
        starts[i] = total;
        total = checked_add(total, spans[i].nbytes, "loader_fill", "the total bytes of src");
    }
    const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(num_threads, total / kMinBytesPerThread));
    if (nt == 1) {
        copy_range(spans, starts, 0, total);
        return;
    }
    // Split the byte stream into nt page-aligned ranges; range 0 runs on this thread.
    std::vector<int64_t> bounds(static_cast<size_t>(nt) + 1);
    for (int64_t t = 0; t <= nt; ++t) {
        const int64_t b = (total / nt) * t + (total % nt) * t / nt; // total * t / nt without overflow
        bounds[static_cast<size_t>(t)] = (t == nt) ? total : (b / kChunkAlign) * kChunkAlign;
    }
    std::vector<std::thread> workers;
    workers.reserve(static_cast<size_t>(nt) - 1);
    int64_t spawned = 1;
    try {
        for (; spawned < nt; ++spawned) {
            const int64_t b = bounds[static_cast<size_t>(spawned)];
            const int64_t e = bounds[static_cast<size_t>(spawned) + 1];
            workers.emplace_back([&spans, &starts, b, e] { copy_range(spans, starts, b, e); });
        }
    } catch (const std::system_error &) {
        // Could not start a thread (resource limits): copy the remaining ranges here.
    }
    copy_range(spans, starts, bounds[0], bounds[1]);
    copy_range(spans, starts, bounds[static_cast<size_t>(spawned)], total);
    for (auto &w : workers) {
        w.join();
    }
}

// Number of references to the storage of `t` (tensors and views that share it). The loader reuses a CPU ring slot
// only when nothing but the ring holds it, so a batch that the consumer kept is never overwritten.
int64_t loader_use_count(const at::Tensor &t) {
    if (!t.has_storage()) {
        return 0;
    }
    return static_cast<int64_t>(t.storage().use_count());
}

} // namespace
} // namespace fastdl::loader

TORCH_LIBRARY_IMPL(fastdl_cpp, CPU, m) {
    m.impl("loader_fill", &fastdl::loader::loader_fill);
    m.impl("loader_use_count", &fastdl::loader::loader_use_count);
}

// A src on another device or of another layout dispatches loader_fill to that key: the same kernel runs there only to
// raise its argument error (RuntimeError for the device, TypeError for the layout), as the torch backend does,
// instead of the dispatcher's NotImplementedError.
TORCH_LIBRARY_IMPL(fastdl_cpp, CUDA, m) {
    m.impl("loader_fill", &fastdl::loader::loader_fill);
}
TORCH_LIBRARY_IMPL(fastdl_cpp, SparseCPU, m) {
    m.impl("loader_fill", &fastdl::loader::loader_fill);
}
TORCH_LIBRARY_IMPL(fastdl_cpp, SparseCsrCPU, m) {
    m.impl("loader_fill", &fastdl::loader::loader_fill);
}
TORCH_LIBRARY_IMPL(fastdl_cpp, QuantizedCPU, m) {
    m.impl("loader_fill", &fastdl::loader::loader_fill);
}
