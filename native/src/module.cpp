// cache._native: the native core's bindings (issue 47). Skeleton: kernels land here.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

NB_MODULE(_native, m) {
    m.doc() = "blocktrie's native core";
    m.attr("ABI") = 1;
}
