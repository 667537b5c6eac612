/* tests/unit/test_busguard.c: a shared mapping that shrinks under us
 * trips the guard instead of killing the process. */
#include <criterion/criterion.h>

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "base/busguard.h"

Test(busguard, a_shrunk_mapping_reads_zero_and_trips_only_its_slot)
{
    long page = sysconf(_SC_PAGESIZE);
    int fd = memfd_create("busguard", MFD_CLOEXEC);
    volatile unsigned char *map;
    int slot, other;
    static char elsewhere[64];

    cr_assert_geq(fd, 0);
    cr_assert_eq(ftruncate(fd, 4 * page), 0);
    map = mmap(NULL, (size_t)(4 * page), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    cr_assert_neq((void *)map, MAP_FAILED);
    memset((void *)map, 0x5a, (size_t)(4 * page));
    slot = busguard_watch((void *)map, (size_t)(4 * page));
    other = busguard_watch(elsewhere, sizeof(elsewhere));
    cr_assert_geq(slot, 0);
    cr_assert_geq(other, 0);
    cr_assert_neq(slot, other);
    cr_assert_not(busguard_tripped(slot));

    /* What an unsealed trainer could do: the file ends after page 1. */
    cr_assert_eq(ftruncate(fd, page), 0);
    cr_assert_eq(map[0], 0x5a, "the page still backed by the file is intact");
    cr_assert_eq(map[2 * page + 7], 0, "a page past the end reads as zero");
    map[3 * page] = 1;                          /* and takes a write */
    cr_assert(busguard_tripped(slot));
    cr_assert_not(busguard_tripped(other), "only the faulting range trips");

    busguard_unwatch(slot);
    busguard_unwatch(other);
    cr_assert_not(busguard_tripped(slot));
    munmap((void *)map, (size_t)(4 * page));
    close(fd);
}

Test(busguard, bad_ranges_and_a_full_table_are_refused)
{
    static char area[BUSGUARD_SLOTS + 1];
    int slots[BUSGUARD_SLOTS];

    cr_assert_eq(busguard_watch(NULL, 10), -EINVAL);
    cr_assert_eq(busguard_watch(area, 0), -EINVAL);
    for (int i = 0; i < BUSGUARD_SLOTS; i++) {
        slots[i] = busguard_watch(&area[i], 1);
        cr_assert_geq(slots[i], 0);
    }
    cr_assert_eq(busguard_watch(&area[BUSGUARD_SLOTS], 1), -ENOSPC);
    busguard_unwatch(slots[3]);
    cr_assert_geq(busguard_watch(&area[BUSGUARD_SLOTS], 1), 0, "a released slot is reused");
    for (int i = 0; i < BUSGUARD_SLOTS; i++)
        busguard_unwatch(i);
    busguard_unwatch(-1);                       /* ignored */
    cr_assert_not(busguard_tripped(BUSGUARD_SLOTS));
}
