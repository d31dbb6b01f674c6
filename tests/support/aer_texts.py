"""AER counter files as kernels other than the fixture host's write them (sysfs aer_dev_*)."""

# aer_dev_correctable of a 4.19 kernel, whose counter names had spaces, and a 6.x file with a
# counted bit the kernel has no name for.
OLD_KERNEL_AER = """\
Receiver Error 2
Bad TLP 0
Bad DLLP 0
RELAY_NUM Rollover 0
Replay Timer Timeout 0
Advisory Non-Fatal 0
Corrected Internal Error 0
Header Log Overflow 0
TOTAL_ERR_COR 2
"""
UNNAMED_BIT_AER = "Undefined 0\nDLP 0\ndev_fatal_errs_bit[27] 1\nTOTAL_ERR_FATAL 1\n"
