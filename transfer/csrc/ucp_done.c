/* Completion callbacks for UCP requests posted from Python (transfer/ucp_iov.py).
 *
 * UCP calls these on ucxx's progress thread, inside the worker's lock. A Python callback would
 * have to take the GIL there, and a Python thread holding the GIL while it waits for that lock
 * would deadlock the two. Each request has an op slot of ours (its user data): the callback
 * stores UCP's status there, gives the request back to UCP, and writes the slot's address to a
 * non-blocking pipe the asyncio loop reads. A full pipe sets duet_ucp_overflowed: the loop then
 * looks at every slot.
 *
 * Why the request is freed here: ucp_request_free takes the worker's lock, a spinlock. Called from
 * the loop right after the callback's report, it spun while the progress thread, still inside
 * the same progress call, held the lock: 1.2 ms of CPU per message on 2 cores, 20-28% of a
 * 16-64 MiB pull (docs/benchmarks/transfer.md, nineteenth pass). Here the lock is already held.
 *
 * A cancel must not name a request the callback has freed (UCP may have handed that memory to
 * another request by then), so the slot's state decides who frees: the callback moves it from
 * OUT to FREED and frees; duet_ucp_cancel moves it from OUT to CANCELLING before it cancels, and a
 * callback that finds CANCELLING only marks it ENDED, leaving the request to the loop. */
#include <stdint.h>
#include <unistd.h>

enum { DUET_OUT = 0, DUET_CANCELLING = 1, DUET_FREED = 2, DUET_ENDED = 3 };

typedef struct {
    int64_t fd;      /* the pipe's write end */
    int64_t state;   /* DUET_*, changed atomically */
    int64_t status;  /* UCP's status (ucs_status_t), set before the state leaves OUT/CANCELLING */
    void *request;   /* set by the loop once the post returned it (for duet_ucp_cancel) */
} duet_op;

int duet_ucp_overflowed = 0;
const int64_t duet_op_size = sizeof(duet_op); /* checked against ucp_abi.OpSlot at load */
static void (*free_request)(void *request);
static void (*cancel_request)(void *worker, void *request);

/* libucp's ucp_request_free and ucp_request_cancel (the library ucxx loaded). */
void duet_ucp_use(void *free_fn, void *cancel_fn) {
    free_request = (void (*)(void *))free_fn;
    cancel_request = (void (*)(void *, void *))cancel_fn;
}

static void done(void *request, int8_t status, duet_op *op) {
    int64_t expected = DUET_OUT;
    __atomic_store_n(&op->status, (int64_t)status, __ATOMIC_RELAXED);
    if (__atomic_compare_exchange_n(&op->state, &expected, DUET_FREED, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE)) {
        free_request(request);
    } else { /* CANCELLING: the loop frees it once it reads this report */
        __atomic_store_n(&op->state, DUET_ENDED, __ATOMIC_RELEASE);
    }
    /* 8 bytes are below PIPE_BUF: written whole or not at all. */
    if (write((int)op->fd, &op, sizeof op) != (ssize_t)sizeof op) {
        __atomic_store_n(&duet_ucp_overflowed, 1, __ATOMIC_SEQ_CST);
    }
}

void duet_ucp_send_done(void *request, int8_t status, void *user_data) {
    done(request, status, (duet_op *)user_data);
}

void duet_ucp_recv_done(void *request, int8_t status, const void *tag_info, void *user_data) {
    (void)tag_info;
    done(request, status, (duet_op *)user_data);
}

/* On the loop: cancel op's request unless its callback has already freed it. 1 if cancelled. */
int duet_ucp_cancel(void *worker, duet_op *op) {
    int64_t expected = DUET_OUT;
    if (!__atomic_compare_exchange_n(&op->state, &expected, DUET_CANCELLING, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE)) {
        return 0;
    }
    cancel_request(worker, op->request);
    return 1;
}

/* On the loop: op's state, read after the callback's stores (status is valid once it is FREED or
 * ENDED). */
int64_t duet_ucp_state(duet_op *op, int64_t *status) {
    int64_t state = __atomic_load_n(&op->state, __ATOMIC_ACQUIRE);
    *status = __atomic_load_n(&op->status, __ATOMIC_RELAXED);
    return state;
}
