/* Completion callbacks for UCP requests posted from Python (transfer/ucp_iov.py).
 *
 * UCP calls these on ucxx's progress thread, inside the worker's lock. A Python callback would
 * have to take the GIL there, and a Python thread holding the GIL while it waits for that lock
 * would deadlock the two. These only write the finished request's address to a non-blocking pipe
 * (its write end is the request's user data); the asyncio loop reads the pipe and asks UCP about
 * those requests. A full pipe sets duet_ucp_overflowed: the loop then asks about every request. */
#include <stdint.h>
#include <unistd.h>

int duet_ucp_overflowed = 0;

static void report(void *request, void *user_data) {
    /* 8 bytes are below PIPE_BUF: written whole or not at all. */
    if (write((int)(intptr_t)user_data, &request, sizeof request) != (ssize_t)sizeof request) {
        __atomic_store_n(&duet_ucp_overflowed, 1, __ATOMIC_SEQ_CST);
    }
}

void duet_ucp_send_done(void *request, int8_t status, void *user_data) {
    (void)status;
    report(request, user_data);
}

void duet_ucp_recv_done(void *request, int8_t status, const void *tag_info, void *user_data) {
    (void)status;
    (void)tag_info;
    report(request, user_data);
}
