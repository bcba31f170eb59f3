/*
 * A fake libibverbs.so.1 for testing rdmx's NIC provider on hosts without an
 * RDMA NIC. It is NOT a provider: one in-process "device" (fake0) whose RC
 * queue pairs reach each other through memory, executing each work request
 * when it is posted. It checks what a NIC checks (lkeys of local buffers,
 * R_Keys, bounds and rights of remote accesses, atomic alignment, receive
 * buffer length, QP state), keeps PSNs as a NIC does (one per MTU-sized
 * packet, READ: one per response packet, atomics: one), moves both QPs to
 * ERROR on a remote access error and flushes, generates CQEs only for
 * signaled requests (and errors), and signals completion channels through an
 * eventfd once a CQ is armed.
 *
 * Build: cc -shared -fPIC -o libibverbs.so.1 fake_verbs.c   (needs libibverbs-dev
 * for the struct layouts). Used by transport-rdma/tests/conformance_hw.rs.
 */
#include <infiniband/verbs.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#undef ibv_get_device_list
#undef ibv_reg_mr
#undef ibv_query_port

static pthread_mutex_t big = PTHREAD_MUTEX_INITIALIZER;

/* ---- memory regions ---------------------------------------------------- */
struct fmr {
	struct ibv_mr mr;
	int access;
	struct fmr *next;
};
static struct fmr *mrs;
static uint32_t next_key = 0x1000;

static struct fmr *mr_by_rkey(uint32_t rkey)
{
	for (struct fmr *m = mrs; m; m = m->next)
		if (m->mr.rkey == rkey)
			return m;
	return NULL;
}

/* A local buffer [addr, addr+len) under lkey, with `need` rights. */
static int local_ok(uint32_t lkey, uint64_t addr, uint64_t len, int need)
{
	if (len == 0)
		return 1;
	for (struct fmr *m = mrs; m; m = m->next) {
		uint64_t a = (uint64_t)(uintptr_t)m->mr.addr;
		if (m->mr.lkey == lkey && addr >= a && addr + len <= a + m->mr.length)
			return (m->access & need) == need;
	}
	return 0;
}

/* ---- completion queues and channels ------------------------------------ */
struct fcq {
	struct ibv_cq cq;
	struct ibv_wc *ring;
	int cap, head, count;
	int armed;
};

static void cq_push(struct ibv_cq *c, struct ibv_wc *wc)
{
	struct fcq *q = (struct fcq *)c;
	if (q->count == q->cap) {
		int ncap = q->cap ? q->cap * 2 : 64;
		struct ibv_wc *n = calloc(ncap, sizeof(*n));
		for (int i = 0; i < q->count; i++)
			n[i] = q->ring[(q->head + i) % q->cap];
		free(q->ring);
		q->ring = n;
		q->cap = ncap;
		q->head = 0;
	}
	q->ring[(q->head + q->count) % q->cap] = *wc;
	q->count++;
	if (q->armed && c->channel) {
		uint64_t one = 1;
		q->armed = 0;
		if (write(c->channel->fd, &one, 8) != 8)
			abort();
	}
}

/* ---- queue pairs ----------------------------------------------------------- */
struct rwr {
	uint64_t wr_id;
	uint64_t addr;
	uint32_t len, lkey;
};

struct op { /* a request on its way to (or waiting at) its responder */
	struct fqp *from;
	uint64_t wr_id;
	int opcode, signaled;
	uint32_t imm, rkey;
	uint64_t raddr, local, compare_add, swap;
	uint8_t *data; /* SEND/WRITE payload, gathered at post time */
	uint32_t len, wire_len;
	struct op *next;
};

struct fqp {
	struct ibv_qp qp;
	uint32_t dest, rq_psn, sq_psn, mtu, max_inline;
	struct rwr *rq;
	int rq_cap, rq_head, rq_count;
	struct op *waiting, *waiting_tail; /* requests to us, stalled for a receive */
	struct fqp *next;
};
static struct fqp *qps;
static uint32_t next_qpn = 0x100;

static struct fqp *qp_by_num(uint32_t n)
{
	for (struct fqp *q = qps; q; q = q->next)
		if (q->qp.qp_num == n)
			return q;
	return NULL;
}

static void complete(struct ibv_cq *cq, uint64_t wr_id, int status, int opcode,
		     uint32_t len, uint32_t qpn, int with_imm, uint32_t imm)
{
	struct ibv_wc wc;
	memset(&wc, 0, sizeof(wc));
	wc.wr_id = wr_id;
	wc.status = status;
	wc.opcode = opcode;
	wc.byte_len = len;
	wc.qp_num = qpn;
	if (with_imm) {
		wc.wc_flags = IBV_WC_WITH_IMM;
		wc.imm_data = imm;
	}
	cq_push(cq, &wc);
}

/* ERROR: flush every posted receive. Requests stalled toward us stay unanswered
 * (as a real responder in ERROR drops them) until the QP is destroyed: see
 * forget_qp. */
static void to_error(struct fqp *q)
{
	if (q->qp.state == IBV_QPS_ERR)
		return;
	q->qp.state = IBV_QPS_ERR;
	while (q->rq_count) {
		struct rwr r = q->rq[q->rq_head];
		q->rq_head = (q->rq_head + 1) % q->rq_cap;
		q->rq_count--;
		complete(q->qp.recv_cq, r.wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0,
			 q->qp.qp_num, 0, 0);
	}
}

static uint32_t npkts(int opcode, uint32_t len, uint32_t mtu)
{
	if (opcode == IBV_WR_ATOMIC_CMP_AND_SWP || opcode == IBV_WR_ATOMIC_FETCH_AND_ADD)
		return 1;
	return len == 0 ? 1 : (len + mtu - 1) / mtu;
}

static int wc_opcode(int wr_opcode)
{
	switch (wr_opcode) {
	case IBV_WR_SEND:
	case IBV_WR_SEND_WITH_IMM:
		return IBV_WC_SEND;
	case IBV_WR_RDMA_WRITE:
	case IBV_WR_RDMA_WRITE_WITH_IMM:
		return IBV_WC_RDMA_WRITE;
	case IBV_WR_RDMA_READ:
		return IBV_WC_RDMA_READ;
	case IBV_WR_ATOMIC_CMP_AND_SWP:
		return IBV_WC_COMP_SWAP;
	default:
		return IBV_WC_FETCH_ADD;
	}
}

/* A remote access error: the requester gets REM_ACCESS_ERR, both QPs fail. */
static void access_error(struct op *o, struct fqp *resp)
{
	complete(o->from->qp.send_cq, o->wr_id, IBV_WC_REM_ACCESS_ERR, wc_opcode(o->opcode),
		 0, o->from->qp.qp_num, 0, 0);
	to_error(o->from);
	to_error(resp);
}

/* Execute a SEND or WRITE-with-immediate needing a receive; 0 if none yet. */
static int consume_recv(struct op *o, struct fqp *resp)
{
	if (resp->rq_count == 0)
		return 0;
	struct rwr r = resp->rq[resp->rq_head];
	resp->rq_head = (resp->rq_head + 1) % resp->rq_cap;
	resp->rq_count--;
	int send = o->opcode == IBV_WR_SEND || o->opcode == IBV_WR_SEND_WITH_IMM;
	if (send) {
		if (o->len > r.len) {
			complete(resp->qp.recv_cq, r.wr_id, IBV_WC_LOC_LEN_ERR, IBV_WC_RECV, 0,
				 resp->qp.qp_num, 0, 0);
			complete(o->from->qp.send_cq, o->wr_id, IBV_WC_REM_INV_REQ_ERR, IBV_WC_SEND,
				 0, o->from->qp.qp_num, 0, 0);
			to_error(o->from);
			to_error(resp);
			return 1;
		}
		memcpy((void *)(uintptr_t)r.addr, o->data, o->len);
	}
	resp->rq_psn = (resp->rq_psn + npkts(o->opcode, o->len, resp->mtu)) & 0xFFFFFF;
	complete(resp->qp.recv_cq, r.wr_id, IBV_WC_SUCCESS,
		 send ? IBV_WC_RECV : IBV_WC_RECV_RDMA_WITH_IMM, o->len, resp->qp.qp_num,
		 o->opcode != IBV_WR_SEND, o->imm);
	if (o->signaled)
		complete(o->from->qp.send_cq, o->wr_id, IBV_WC_SUCCESS, wc_opcode(o->opcode),
			 o->len, o->from->qp.qp_num, 0, 0);
	return 1;
}

static int is_atomic(int op)
{
	return op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD;
}

/* The responder executes `o`; 0 if it needs a receive that is not posted yet
 * (an RNR NAK: the request waits and runs when one is). */
static int execute(struct op *o, struct fqp *resp)
{
	int op = o->opcode;
	if (op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM)
		return consume_recv(o, resp);
	if (op == IBV_WR_RDMA_WRITE_WITH_IMM && resp->rq_count == 0)
		return 0;
	int rneed = op == IBV_WR_RDMA_READ ? IBV_ACCESS_REMOTE_READ
		    : is_atomic(op)	  ? IBV_ACCESS_REMOTE_ATOMIC
					  : IBV_ACCESS_REMOTE_WRITE;
	if (o->wire_len > 0) {
		struct fmr *m = mr_by_rkey(o->rkey);
		uint64_t a = m ? (uint64_t)(uintptr_t)m->mr.addr : 0;
		if (!m || m->mr.pd != resp->qp.pd || (m->access & rneed) != rneed || o->raddr < a ||
		    o->raddr + o->wire_len > a + m->mr.length || (is_atomic(op) && o->raddr % 8)) {
			access_error(o, resp);
			return 1;
		}
	}
	void *target = (void *)(uintptr_t)o->raddr;
	switch (op) {
	case IBV_WR_RDMA_WRITE:
		memcpy(target, o->data, o->len);
		break;
	case IBV_WR_RDMA_WRITE_WITH_IMM:
		memcpy(target, o->data, o->len);
		return consume_recv(o, resp);
	case IBV_WR_RDMA_READ:
		memcpy((void *)(uintptr_t)o->local, target, o->len);
		break;
	default: {
		uint64_t *w = target, old = *w;
		if (op == IBV_WR_ATOMIC_FETCH_AND_ADD)
			*w = old + o->compare_add;
		else if (old == o->compare_add)
			*w = o->swap;
		memcpy((void *)(uintptr_t)o->local, &old, 8);
	}
	}
	resp->rq_psn = (resp->rq_psn + npkts(op, o->wire_len, resp->mtu)) & 0xFFFFFF;
	if (o->signaled)
		complete(o->from->qp.send_cq, o->wr_id, IBV_WC_SUCCESS, wc_opcode(op), o->wire_len,
			 o->from->qp.qp_num, 0, 0);
	return 1;
}

/* Run stalled requests toward `resp` while receives are there. */
static void drain_waiting(struct fqp *resp)
{
	while (resp->waiting && resp->qp.state != IBV_QPS_ERR) {
		struct op *o = resp->waiting;
		if (o->from->qp.state == IBV_QPS_ERR) {
			complete(o->from->qp.send_cq, o->wr_id, IBV_WC_WR_FLUSH_ERR,
				 wc_opcode(o->opcode), 0, o->from->qp.qp_num, 0, 0);
		} else if (!execute(o, resp)) {
			return;
		}
		resp->waiting = o->next;
		if (!resp->waiting)
			resp->waiting_tail = NULL;
		free(o->data);
		free(o);
	}
}

static int fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
	struct fqp *q = (struct fqp *)qp;
	pthread_mutex_lock(&big);
	for (; wr; wr = wr->next) {
		int signaled = (wr->send_flags & IBV_SEND_SIGNALED) != 0;
		int op = wr->opcode;
		if (q->qp.state != IBV_QPS_RTS) {
			if (q->qp.state == IBV_QPS_ERR) {
				complete(qp->send_cq, wr->wr_id, IBV_WC_WR_FLUSH_ERR, wc_opcode(op), 0,
					 qp->qp_num, 0, 0);
				continue;
			}
			*bad = wr;
			pthread_mutex_unlock(&big);
			return EINVAL;
		}
		uint64_t len = 0;
		for (int i = 0; i < wr->num_sge; i++)
			len += wr->sg_list[i].length;
		int inl = (wr->send_flags & IBV_SEND_INLINE) != 0;
		/* rxe's provider refuses a misaligned atomic when it is posted. */
		if (is_atomic(op) && (wr->wr.atomic.remote_addr & 7)) {
			*bad = wr;
			pthread_mutex_unlock(&big);
			return EINVAL;
		}
		if (inl && len > q->max_inline) {
			*bad = wr;
			pthread_mutex_unlock(&big);
			return EINVAL;
		}
		struct op *o = calloc(1, sizeof(*o));
		o->from = q;
		o->wr_id = wr->wr_id;
		o->opcode = op;
		o->signaled = signaled;
		o->imm = wr->imm_data;
		o->len = (uint32_t)len;
		uint32_t wire_len = is_atomic(op) ? 8 : (uint32_t)len;
		q->sq_psn = (q->sq_psn + npkts(op, wire_len, q->mtu)) & 0xFFFFFF;
		/* Local buffers must be registered (inline data need not be). */
		int need = (op == IBV_WR_RDMA_READ || is_atomic(op)) ? IBV_ACCESS_LOCAL_WRITE : 0;
		int ok = 1;
		for (int i = 0; i < wr->num_sge && !inl; i++)
			ok &= local_ok(wr->sg_list[i].lkey, wr->sg_list[i].addr, wr->sg_list[i].length, need);
		if (!ok) {
			complete(qp->send_cq, wr->wr_id, IBV_WC_LOC_PROT_ERR, wc_opcode(op), 0,
				 qp->qp_num, 0, 0);
			to_error(q);
			free(o);
			continue;
		}
		if (op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM || op == IBV_WR_RDMA_WRITE ||
		    op == IBV_WR_RDMA_WRITE_WITH_IMM) {
			o->data = malloc(len ? len : 1);
			uint64_t at = 0;
			for (int i = 0; i < wr->num_sge; i++) {
				memcpy(o->data + at, (void *)(uintptr_t)wr->sg_list[i].addr,
				       wr->sg_list[i].length);
				at += wr->sg_list[i].length;
			}
		}
		struct fqp *resp = qp_by_num(q->dest);
		if (!resp || resp->qp.state < IBV_QPS_RTR || resp->qp.state == IBV_QPS_ERR) {
			/* Nobody answers: the requester retries, then gives up. */
			complete(qp->send_cq, wr->wr_id, IBV_WC_RETRY_EXC_ERR, wc_opcode(op), 0,
				 qp->qp_num, 0, 0);
			to_error(q);
			free(o->data);
			free(o);
			continue;
		}
		if (op == IBV_WR_RDMA_READ || op == IBV_WR_RDMA_WRITE ||
		    op == IBV_WR_RDMA_WRITE_WITH_IMM) {
			o->raddr = wr->wr.rdma.remote_addr;
			o->rkey = wr->wr.rdma.rkey;
		} else if (is_atomic(op)) {
			o->raddr = wr->wr.atomic.remote_addr;
			o->rkey = wr->wr.atomic.rkey;
			o->compare_add = wr->wr.atomic.compare_add;
			o->swap = wr->wr.atomic.swap;
		}
		if ((op == IBV_WR_RDMA_READ || is_atomic(op)) && wr->num_sge > 0)
			o->local = wr->sg_list[0].addr;
		o->wire_len = wire_len;
		if (resp->waiting) { /* RC order: behind a request waiting for a receive */
			resp->waiting_tail->next = o;
			resp->waiting_tail = o;
			continue;
		}
		if (!execute(o, resp)) {
			resp->waiting = resp->waiting_tail = o;
			continue;
		}
		free(o->data);
		free(o);
	}
	pthread_mutex_unlock(&big);
	return 0;
}

static int fake_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
	struct fqp *q = (struct fqp *)qp;
	pthread_mutex_lock(&big);
	/* A QP in RESET takes no receives (IBTA C10-97.2.1): rxe's provider
	 * fails the call with EINVAL, as here. */
	if (q->qp.state == IBV_QPS_RESET) {
		*bad = wr;
		pthread_mutex_unlock(&big);
		return EINVAL;
	}
	for (; wr; wr = wr->next) {
		if (wr->num_sge != 1 || !local_ok(wr->sg_list[0].lkey, wr->sg_list[0].addr,
						  wr->sg_list[0].length, IBV_ACCESS_LOCAL_WRITE)) {
			*bad = wr;
			pthread_mutex_unlock(&big);
			return EINVAL;
		}
		if (q->qp.state == IBV_QPS_ERR) {
			complete(qp->recv_cq, wr->wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0,
				 qp->qp_num, 0, 0);
			continue;
		}
		if (q->rq_count == q->rq_cap) {
			int ncap = q->rq_cap ? q->rq_cap * 2 : 64;
			struct rwr *n = calloc(ncap, sizeof(*n));
			for (int i = 0; i < q->rq_count; i++)
				n[i] = q->rq[(q->rq_head + i) % q->rq_cap];
			free(q->rq);
			q->rq = n;
			q->rq_cap = ncap;
			q->rq_head = 0;
		}
		q->rq[(q->rq_head + q->rq_count) % q->rq_cap] =
			(struct rwr){ wr->wr_id, wr->sg_list[0].addr, wr->sg_list[0].length,
				      wr->sg_list[0].lkey };
		q->rq_count++;
	}
	drain_waiting(q);
	pthread_mutex_unlock(&big);
	return 0;
}

static int fake_poll_cq(struct ibv_cq *c, int n, struct ibv_wc *wc)
{
	struct fcq *q = (struct fcq *)c;
	int got = 0;
	pthread_mutex_lock(&big);
	while (got < n && q->count) {
		wc[got++] = q->ring[q->head];
		q->head = (q->head + 1) % q->cap;
		q->count--;
	}
	pthread_mutex_unlock(&big);
	return got;
}

static int fake_req_notify_cq(struct ibv_cq *c, int solicited_only)
{
	(void)solicited_only;
	pthread_mutex_lock(&big);
	((struct fcq *)c)->armed = 1;
	pthread_mutex_unlock(&big);
	return 0;
}

/* ---- the exported verbs ------------------------------------------------ */
static struct ibv_device fake_dev;
static struct ibv_device *dev_list[2];

struct ibv_device **ibv_get_device_list(int *num)
{
	strcpy(fake_dev.name, "fake0");
	fake_dev.transport_type = IBV_TRANSPORT_IB;
	dev_list[0] = &fake_dev;
	dev_list[1] = NULL;
	if (num)
		*num = 1;
	return dev_list;
}

void ibv_free_device_list(struct ibv_device **list) { (void)list; }

const char *ibv_get_device_name(struct ibv_device *d) { return d->name; }

__be64 ibv_get_device_guid(struct ibv_device *d)
{
	(void)d;
	return 0x1234;
}

struct ibv_context *ibv_open_device(struct ibv_device *d)
{
	struct ibv_context *c = calloc(1, sizeof(*c));
	c->device = d;
	c->ops.poll_cq = fake_poll_cq;
	c->ops.req_notify_cq = fake_req_notify_cq;
	c->ops.post_send = fake_post_send;
	c->ops.post_recv = fake_post_recv;
	c->cmd_fd = -1;
	c->async_fd = -1;
	c->num_comp_vectors = 1;
	return c;
}

int ibv_close_device(struct ibv_context *c)
{
	free(c);
	return 0;
}

int ibv_query_device(struct ibv_context *c, struct ibv_device_attr *a)
{
	(void)c;
	memset(a, 0, sizeof(*a));
	a->max_qp = 1 << 16;
	a->max_qp_wr = 1 << 15;
	a->max_sge = 4;
	a->max_cq = 1 << 16;
	a->max_cqe = 1 << 20;
	a->max_mr = 1 << 20;
	a->max_pd = 1 << 10;
	a->max_qp_rd_atom = 16;
	a->max_qp_init_rd_atom = 16;
	a->atomic_cap = IBV_ATOMIC_HCA;
	a->phys_port_cnt = 1;
	return 0;
}

/* The port as libibverbs reports it. The active MTU is known only here:
 * the kernel's sysfs has no active_mtu file (rxe's port directory shows
 * cap_mask, gids, gid_attrs, lid, link_layer, phys_state, rate, state...). */
int ibv_query_port(struct ibv_context *c, uint8_t port, struct _compat_ibv_port_attr *compat)
{
	/* the exported symbol takes the older struct, a prefix of today's */
	struct ibv_port_attr *a = (struct ibv_port_attr *)compat;
	(void)c;
	if (port != 1)
		return EINVAL;
	/* only fields of the older struct: the caller's may be that small */
	a->state = IBV_PORT_ACTIVE;
	a->max_mtu = IBV_MTU_4096;
	a->active_mtu = IBV_MTU_2048;
	a->gid_tbl_len = 2;
	a->link_layer = IBV_LINK_LAYER_ETHERNET;
	return 0;
}

struct ibv_pd *ibv_alloc_pd(struct ibv_context *c)
{
	struct ibv_pd *pd = calloc(1, sizeof(*pd));
	pd->context = c;
	return pd;
}

int ibv_dealloc_pd(struct ibv_pd *pd)
{
	free(pd);
	return 0;
}

struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access)
{
	if (len == 0 || !addr) {
		errno = EINVAL;
		return NULL;
	}
	struct fmr *m = calloc(1, sizeof(*m));
	pthread_mutex_lock(&big);
	m->mr.context = pd->context;
	m->mr.pd = pd;
	m->mr.addr = addr;
	m->mr.length = len;
	m->mr.lkey = next_key;
	m->mr.rkey = next_key ^ 0x5A000000;
	next_key++;
	m->access = access | IBV_ACCESS_LOCAL_WRITE;
	m->next = mrs;
	mrs = m;
	pthread_mutex_unlock(&big);
	return &m->mr;
}

int ibv_dereg_mr(struct ibv_mr *mr)
{
	pthread_mutex_lock(&big);
	for (struct fmr **p = &mrs; *p; p = &(*p)->next)
		if (&(*p)->mr == mr) {
			struct fmr *m = *p;
			*p = m->next;
			free(m);
			break;
		}
	pthread_mutex_unlock(&big);
	return 0;
}

struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *c)
{
	struct ibv_comp_channel *ch = calloc(1, sizeof(*ch));
	ch->context = c;
	ch->fd = eventfd(0, 0);
	return ch;
}

int ibv_destroy_comp_channel(struct ibv_comp_channel *ch)
{
	close(ch->fd);
	free(ch);
	return 0;
}

struct ibv_cq *ibv_create_cq(struct ibv_context *c, int cqe, void *ctx,
			     struct ibv_comp_channel *ch, int vec)
{
	(void)vec;
	struct fcq *q = calloc(1, sizeof(*q));
	q->cq.context = c;
	q->cq.channel = ch;
	q->cq.cq_context = ctx;
	q->cq.cqe = cqe;
	if (ch)
		ch->refcnt++;
	return &q->cq;
}

int ibv_destroy_cq(struct ibv_cq *c)
{
	struct fcq *q = (struct fcq *)c;
	if (c->channel)
		c->channel->refcnt--;
	free(q->ring);
	free(q);
	return 0;
}

int ibv_get_cq_event(struct ibv_comp_channel *ch, struct ibv_cq **cq, void **ctx)
{
	uint64_t n;
	if (read(ch->fd, &n, 8) != 8)
		return -1; /* EAGAIN on a non-blocking channel */
	/* One CQ per channel in rdmx: find it. */
	*cq = NULL;
	*ctx = NULL;
	return 0;
}

void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int n)
{
	(void)cq;
	(void)n;
}

struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *a)
{
	if (a->qp_type != IBV_QPT_RC || a->cap.max_inline_data > 256) {
		errno = EINVAL;
		return NULL;
	}
	struct fqp *q = calloc(1, sizeof(*q));
	pthread_mutex_lock(&big);
	q->qp.context = pd->context;
	q->qp.pd = pd;
	q->qp.send_cq = a->send_cq;
	q->qp.recv_cq = a->recv_cq;
	q->qp.qp_type = a->qp_type;
	q->qp.qp_num = next_qpn++;
	q->qp.state = IBV_QPS_RESET;
	q->max_inline = a->cap.max_inline_data;
	q->mtu = 1024;
	q->next = qps;
	qps = q;
	pthread_mutex_unlock(&big);
	return &q->qp;
}

/* `gone` is being destroyed: requests of its own stalled at other responders
 * vanish with it, and requests stalled toward it are never answered, so each
 * requester retries until it gives up (RETRY_EXC_ERR, then the QP is in
 * ERROR and the rest flush), as against a real peer that went away. */
static void forget_qp(struct fqp *gone)
{
	for (struct fqp *p = qps; p; p = p->next) {
		struct op **link = &p->waiting, *last = NULL;
		while (*link) {
			struct op *o = *link;
			if (o->from == gone) {
				*link = o->next;
				free(o->data);
				free(o);
			} else {
				last = o;
				link = &o->next;
			}
		}
		p->waiting_tail = last;
	}
	while (gone->waiting) {
		struct op *o = gone->waiting;
		gone->waiting = o->next;
		struct fqp *r = o->from;
		if (r == gone) {
			/* Its own request, looped back: nobody is left to tell. */
		} else if (r->qp.state != IBV_QPS_ERR) {
			complete(r->qp.send_cq, o->wr_id, IBV_WC_RETRY_EXC_ERR,
				 wc_opcode(o->opcode), 0, r->qp.qp_num, 0, 0);
			to_error(r);
		} else {
			complete(r->qp.send_cq, o->wr_id, IBV_WC_WR_FLUSH_ERR,
				 wc_opcode(o->opcode), 0, r->qp.qp_num, 0, 0);
		}
		free(o->data);
		free(o);
	}
	gone->waiting_tail = NULL;
}

int ibv_destroy_qp(struct ibv_qp *qp)
{
	pthread_mutex_lock(&big);
	for (struct fqp **p = &qps; *p; p = &(*p)->next)
		if (&(*p)->qp == qp) {
			struct fqp *q = *p;
			*p = q->next;
			forget_qp(q);
			free(q->rq);
			free(q);
			break;
		}
	pthread_mutex_unlock(&big);
	return 0;
}

int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask)
{
	struct fqp *q = (struct fqp *)qp;
	pthread_mutex_lock(&big);
	int rc = 0;
	if (mask & IBV_QP_STATE) {
		enum ibv_qp_state to = a->qp_state, from = q->qp.state;
		int need = 0;
		if (to == IBV_QPS_INIT && from == IBV_QPS_RESET)
			need = IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
		else if (to == IBV_QPS_RTR && from == IBV_QPS_INIT)
			need = IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
			       IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
		else if (to == IBV_QPS_RTS && from == IBV_QPS_RTR)
			need = IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
			       IBV_QP_MAX_QP_RD_ATOMIC;
		else if (to == IBV_QPS_ERR)
			need = 0;
		else
			rc = EINVAL;
		if (!rc && (mask & need) != need)
			rc = EINVAL;
		if (!rc && to == IBV_QPS_RTR &&
		    (!a->ah_attr.is_global || a->path_mtu < IBV_MTU_256 || a->path_mtu > IBV_MTU_4096))
			rc = EINVAL;
		if (!rc) {
			if (to == IBV_QPS_RTR) {
				q->dest = a->dest_qp_num;
				q->rq_psn = a->rq_psn;
				q->mtu = 128u << a->path_mtu;
			}
			if (to == IBV_QPS_RTS)
				q->sq_psn = a->sq_psn;
			if (to == IBV_QPS_ERR)
				to_error(q);
			else
				q->qp.state = to;
		}
	}
	pthread_mutex_unlock(&big);
	return rc;
}

int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask, struct ibv_qp_init_attr *init)
{
	struct fqp *q = (struct fqp *)qp;
	(void)mask;
	pthread_mutex_lock(&big);
	memset(a, 0, sizeof(*a));
	memset(init, 0, sizeof(*init));
	a->qp_state = q->qp.state;
	a->cur_qp_state = q->qp.state;
	a->rq_psn = q->rq_psn;
	a->sq_psn = q->sq_psn;
	a->dest_qp_num = q->dest;
	pthread_mutex_unlock(&big);
	return 0;
}
