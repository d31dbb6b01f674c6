/*
 * What the stub libnvidia-ml knows: the GPUs its layout file describes (stub_layout.c reads it) and
 * the scripted failures; stub_nvml.c answers the NVML entry points from it. See stub_nvml.c for why
 * the stub exists and the layout format.
 */
#ifndef HYBRIDMON_STUB_STATE_H
#define HYBRIDMON_STUB_STATE_H

/* Declares every entry point under its own symbol name (why: stub_nvml.c). */
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include "nvml.h"

#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

#define STUB_MAX_GPUS 8
#define STUB_MAX_PROCESSES 16
#define STUB_MAX_FIELDS 8
#define STUB_MAX_FAILS 32
#define STUB_MAX_AFFINITY_WORDS 16
#define STUB_MAX_C2C_LINKS 16
#define STUB_MAX_GPM_METRICS 8

struct stub_fail {
    char function[80];
    nvmlReturn_t code;
};

struct stub_process {
    char kind[16];               /* compute, graphics or mps */
    unsigned int pid;
    unsigned long long used;     /* NVML_VALUE_NOT_AVAILABLE as unsigned when "na" */
    char name[256];
};

struct stub_field {
    unsigned int id;
    unsigned long long value;
};

struct stub_c2c_link {
    unsigned int up;                 /* NVML_FI_DEV_C2C_LINK_GET_STATUS: 0 inactive, 1 active */
    unsigned long long max_mbps;     /* NVML_FI_DEV_C2C_LINK_GET_MAX_BW, "in MBps" (nvml.h) */
};

struct stub_gpm_metric {
    unsigned int id;                 /* nvmlGpmMetricId_t */
    double value;                    /* what nvmlGpmMetricsGet answers over any two samples */
};

/* nvml.h only declares `struct nvmlDevice_st`; a handle is a pointer to one of these. */
struct nvmlDevice_st {
    unsigned int index;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned int pci_device_id, pci_subsystem_id;
    unsigned long long memory_total, memory_reserved, memory_used;
    unsigned int pcie_rx_kbps, pcie_tx_kbps;
    /* layout line pcie_counters_advance 1: fields 197/198 (the PCIe byte counters) grow at
       pcie_tx_kbps/pcie_rx_kbps from the layout's load, as a driver's counters do */
    int pcie_counters_advance;
    unsigned int link_gen, link_gen_max, link_width, link_width_max, replays;
    unsigned int util_gpu, util_memory, numa_node, mig_current, mig_pending;
    unsigned long cpu_affinity[STUB_MAX_AFFINITY_WORDS];
    unsigned int cpu_affinity_words;
    struct stub_field fields[STUB_MAX_FIELDS];
    unsigned int field_count;
    struct stub_process processes[STUB_MAX_PROCESSES];
    unsigned int process_count;
    int c2c_mode;                    /* -1: nvmlDeviceGetC2cModeInfoV NOT_SUPPORTED; else isC2cEnabled */
    struct stub_c2c_link c2c_links[STUB_MAX_C2C_LINKS];
    unsigned int c2c_link_count;
    unsigned int gpm_supported;      /* nvmlGpmSupport_t isSupportedDevice */
    struct stub_gpm_metric gpm_metrics[STUB_MAX_GPM_METRICS];
    unsigned int gpm_metric_count;
    struct stub_fail fails[STUB_MAX_FAILS];
    unsigned int fail_count;
};

/* The stub's own state and helpers stay out of the library's exported symbols. */
#define STUB_INTERNAL __attribute__((visibility("hidden")))

STUB_INTERNAL extern struct nvmlDevice_st gpus[STUB_MAX_GPUS];
STUB_INTERNAL extern unsigned int gpu_count;
STUB_INTERNAL extern char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
STUB_INTERNAL extern struct stub_fail system_fails[STUB_MAX_FAILS];
STUB_INTERNAL extern unsigned int system_fail_count;
/* How long nvmlDeviceGetPcieThroughput blocks, µs (layout line pcie_window_us; 0 unless set). */
STUB_INTERNAL extern unsigned int pcie_window_us;

/* 0, or -1 after saying on stderr which layout line is bad. */
STUB_INTERNAL int load_layout(void);
STUB_INTERNAL void count_call(const char *function);

#endif
