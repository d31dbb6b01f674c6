/*
 * nvml.h's layout, for the ABI check in tests/exporters/test_real_pynvml.py (not NVML entry
 * points). Each row is one member of one nvml.h type as this compiler lays it out from the header;
 * the test compares pynvml's ctypes classes with them. A row with an empty member is the sizeof.
 */
#include "stub_state.h"

struct hybridmon_stub_member {
    const char *type;
    const char *member;
    size_t offset;
    size_t size;
};

#define TYPE_SIZE(T) {#T, "", 0, sizeof(T)}
#define MEMBER(T, M) {#T, #M, offsetof(T, M), sizeof(((T *)0)->M)}

static const struct hybridmon_stub_member header_members[] = {
    TYPE_SIZE(nvmlProcessInfo_t),
    MEMBER(nvmlProcessInfo_t, pid), MEMBER(nvmlProcessInfo_t, usedGpuMemory),
    MEMBER(nvmlProcessInfo_t, gpuInstanceId), MEMBER(nvmlProcessInfo_t, computeInstanceId),
    TYPE_SIZE(nvmlProcessInfo_v2_t),
    MEMBER(nvmlProcessInfo_v2_t, pid), MEMBER(nvmlProcessInfo_v2_t, usedGpuMemory),
    MEMBER(nvmlProcessInfo_v2_t, gpuInstanceId), MEMBER(nvmlProcessInfo_v2_t, computeInstanceId),
    TYPE_SIZE(nvmlProcessInfo_v1_t),
    MEMBER(nvmlProcessInfo_v1_t, pid), MEMBER(nvmlProcessInfo_v1_t, usedGpuMemory),
    TYPE_SIZE(nvmlMemory_t),
    MEMBER(nvmlMemory_t, total), MEMBER(nvmlMemory_t, free), MEMBER(nvmlMemory_t, used),
    TYPE_SIZE(nvmlMemory_v2_t),
    MEMBER(nvmlMemory_v2_t, version), MEMBER(nvmlMemory_v2_t, total),
    MEMBER(nvmlMemory_v2_t, reserved), MEMBER(nvmlMemory_v2_t, free), MEMBER(nvmlMemory_v2_t, used),
    TYPE_SIZE(nvmlPciInfo_t),
    MEMBER(nvmlPciInfo_t, busIdLegacy), MEMBER(nvmlPciInfo_t, domain), MEMBER(nvmlPciInfo_t, bus),
    MEMBER(nvmlPciInfo_t, device), MEMBER(nvmlPciInfo_t, pciDeviceId),
    MEMBER(nvmlPciInfo_t, pciSubSystemId), MEMBER(nvmlPciInfo_t, busId),
    TYPE_SIZE(nvmlUtilization_t),
    MEMBER(nvmlUtilization_t, gpu), MEMBER(nvmlUtilization_t, memory),
    TYPE_SIZE(nvmlValue_t),
    MEMBER(nvmlValue_t, dVal), MEMBER(nvmlValue_t, siVal), MEMBER(nvmlValue_t, uiVal),
    MEMBER(nvmlValue_t, ulVal), MEMBER(nvmlValue_t, ullVal), MEMBER(nvmlValue_t, sllVal),
    MEMBER(nvmlValue_t, usVal),
    TYPE_SIZE(nvmlFieldValue_t),
    MEMBER(nvmlFieldValue_t, fieldId), MEMBER(nvmlFieldValue_t, scopeId),
    MEMBER(nvmlFieldValue_t, timestamp), MEMBER(nvmlFieldValue_t, latencyUsec),
    MEMBER(nvmlFieldValue_t, valueType), MEMBER(nvmlFieldValue_t, nvmlReturn),
    MEMBER(nvmlFieldValue_t, value),
    TYPE_SIZE(nvmlC2cModeInfo_v1_t),
    MEMBER(nvmlC2cModeInfo_v1_t, isC2cEnabled),
    TYPE_SIZE(nvmlGpmSupport_t),
    MEMBER(nvmlGpmSupport_t, version), MEMBER(nvmlGpmSupport_t, isSupportedDevice),
    /* nvmlGpmMetricsGet_t is left out: its metrics[] is NVML_GPM_METRIC_MAX long, which grows with
     * the header (210 here, 477 in pynvml 13.615.71) under the same version 1; the members before
     * it are compared by the probe (gpm_request_layout). */
    TYPE_SIZE(nvmlGpmMetric_t),
    MEMBER(nvmlGpmMetric_t, metricId), MEMBER(nvmlGpmMetric_t, nvmlReturn),
    MEMBER(nvmlGpmMetric_t, value), MEMBER(nvmlGpmMetric_t, metricInfo),
    MEMBER(nvmlGpmMetricsGet_t, version), MEMBER(nvmlGpmMetricsGet_t, numMetrics),
    MEMBER(nvmlGpmMetricsGet_t, sample1), MEMBER(nvmlGpmMetricsGet_t, sample2),
};

/* Row `index` of the table, or NULL past its end. */
const struct hybridmon_stub_member *hybridmon_stub_header_member(unsigned int index)
{
    if (index >= sizeof header_members / sizeof header_members[0]) {
        return NULL;
    }
    return &header_members[index];
}

/* The version word nvml.h stamps on nvmlMemory_v2_t (pynvml's nvmlMemory_v2 must equal it). */
unsigned int hybridmon_stub_memory_v2_version(void)
{
    return nvmlMemory_v2;
}
