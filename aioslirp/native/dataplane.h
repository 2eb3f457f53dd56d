/* aioslirp's native data plane: the C core (C11, no Python object in it).
 *
 * The core is sans-IO where it can be: dp_classify() reads a buffer and writes a fixed-size
 * record; the one syscall loop, dp_tap_read(), sits behind a plain fd. The CPython binding is
 * _dataplane.c (limited API), the Python face aioslirp/native/__init__.py.
 *
 * Every length taken from the wire (virtio-net header, Ethernet, IPv4 IHL and total length,
 * IPv6 payload length, TCP data offset and options, UDP length) is checked once, in
 * dp_classify(), against the buffer it came in; what follows reads only inside the offsets
 * the record holds. A frame that fails a check is classified DP_KIND_DROP with its reason.
 *
 * MIT licensed, written for aioslirp. Ideas (batch reads until EAGAIN, a fixed record per
 * frame) follow passt's design notes; no passt code is used.
 */
#ifndef AIOSLIRP_DATAPLANE_H
#define AIOSLIRP_DATAPLANE_H

#include <stddef.h>
#include <stdint.h>

#define DP_VNET_HDR_LEN 12u /* struct virtio_net_hdr_v1 after TUNSETVNETHDRSZ 12 */
#define DP_ETH_HLEN 14u

/* What a frame is: a NAT flow's segment the native plane may own (TCP, UDP), a frame for the
 * Python path (ARP, ICMP, fragments, IPv6 extension headers: the reason says which), or a drop. */
enum dp_kind {
    DP_KIND_DROP = 0,
    DP_KIND_TCP = 1,
    DP_KIND_UDP = 2,
    DP_KIND_NOT_NATIVE = 3,
};

/* Reasons: for DP_KIND_DROP the names the Python dispatch counts as drop.<name> (IPv4 names;
 * the IPv6 ones where they differ); for DP_KIND_NOT_NATIVE why Python takes the frame.
 * The order is the ABI of the binding (dp_reason_name()). */
enum dp_reason {
    DP_R_NONE = 0,
    /* drops */
    DP_R_TRUNCATED_VNET,     /* a virtio-net header without a frame */
    DP_R_TRUNCATED_ETH,      /* shorter than an Ethernet header */
    DP_R_BAD_SRC_MAC,        /* multicast/broadcast source MAC */
    DP_R_UNKNOWN_ETHERTYPE,
    DP_R_TRUNCATED_IP,       /* IPv4: shorter than 14 + 20 */
    DP_R_BAD_IP_HEADER,      /* IPv4: version != 4 or IHL < 5 */
    DP_R_BAD_IP_LENGTH,      /* IPv4: total length < IHL or past the frame */
    DP_R_BAD_IP_CHECKSUM,    /* IPv4 header checksum */
    DP_R_UNKNOWN_IP_PROTO,   /* IPv4: not TCP, UDP or ICMP */
    DP_R_IPV6_TRUNCATED,
    DP_R_IPV6_BAD_VERSION,
    DP_R_IPV6_JUMBOGRAM,     /* payload length 0 (and Next Header not 59) */
    DP_R_IPV6_BAD_LENGTH,    /* payload length past the frame */
    DP_R_IPV6_BAD_SRC,       /* multicast source */
    DP_R_TRUNCATED_TCP,      /* fewer than 20 bytes of TCP (IPv6: tcp6_truncated) */
    DP_R_BAD_TCP_HEADER,     /* data offset < 5 or past the segment; a malformed option list */
    DP_R_TRUNCATED_UDP,      /* fewer than 8 bytes of UDP (IPv6: udp6_truncated) */
    DP_R_BAD_UDP_LENGTH,     /* UDP length < 8 or past the packet (IPv6: udp6_bad_length) */
    /* not native: the Python path takes these */
    DP_R_ARP,
    DP_R_ICMP,               /* ICMP or ICMPv6 */
    DP_R_FRAGMENT,           /* an IPv4 fragment (reassembled in Python) */
    DP_R_IPV6_EXT,           /* IPv6 with extension headers, or No Next Header */
    DP_R_COUNT
};

/* DP_F_* flags of a record. */
#define DP_F_CSUM_OK 0x01u /* vnet header: NEEDS_CSUM or DATA_VALID (the guest kernel's word) */
#define DP_F_VNET 0x02u    /* the buffer starts with a virtio-net header */
#define DP_F_IPV6 0x04u    /* the addresses are 16 bytes (else 4, in src[0..3] / dst[0..3]) */

/* The fixed-size record of one classified frame. Offsets are from the start of the buffer
 * handed to dp_classify() (the virtio-net header, when there is one, is at 0). Fields past
 * the point where a drop was decided are 0. For TCP/UDP: l3_off < l4_off < payload_off <=
 * payload_off + payload_len <= end <= the buffer's length; TCP: payload_len == end -
 * payload_off; UDP: payload_len is its length field - 8 (bytes after it, up to end, are not
 * payload). end excludes Ethernet padding (bytes past the IP length). */
struct dp_frame {
    uint8_t kind;       /* enum dp_kind */
    uint8_t reason;     /* enum dp_reason */
    uint8_t flags;      /* DP_F_* */
    uint8_t proto;      /* IPv4 protocol / IPv6 next header; 0 before the IP header */
    uint8_t tcp_flags;  /* TCP: the 6 low flag bits (FIN SYN RST PSH ACK URG) */
    uint8_t pad[1];
    uint16_t ethertype;
    uint32_t l2_off;    /* 0, or 12 with a virtio-net header */
    uint32_t l3_off;
    uint32_t l4_off;
    uint32_t payload_off;
    uint32_t payload_len;
    uint32_t end;       /* end of the IP packet (l3_off + its length) */
    uint16_t sport, dport;
    uint8_t src[16], dst[16];
};

/* Drop and classification counters of one plane (by reason), and frames seen. */
struct dp_counters {
    uint64_t frames;
    uint64_t by_reason[DP_R_COUNT];
};

/* Classify the frame in buf[0..len) (with a leading virtio-net header when vnet is non-zero)
 * into *out; counts it in *counters when that is not NULL. Returns out->kind. Never reads
 * outside buf[0..len). */
int dp_classify(const uint8_t *buf, size_t len, int vnet, struct dp_frame *out, struct dp_counters *counters);

/* The name of a reason ("bad_ip_length"), its IPv6 name for the L4 reasons that have one
 * (dp_reason_name6), or NULL past DP_R_COUNT. */
const char *dp_reason_name(unsigned reason);
const char *dp_reason_name6(unsigned reason);

/* One frame read from the TAP fd: where in the read buffer, how long, the vnet checksum bit. */
struct dp_slot {
    uint32_t off;
    uint32_t len;
    uint8_t csum_ok;
};

/* The outcome of one dp_tap_read() call. */
enum dp_read_end {
    DP_READ_FULL = 0,    /* the buffer or the slots ran out, reads left: call again */
    DP_READ_DONE = 1,    /* max_reads reads done */
    DP_READ_AGAIN = 2,   /* EAGAIN/EWOULDBLOCK/EINTR: nothing more now */
    DP_READ_EOF = 3,     /* a read returned 0 */
    DP_READ_ERROR = 4,   /* a read failed: *err holds errno */
};

/* Read frames from fd (one frame per read(), as a TAP gives them) into buf[0..cap), each read
 * offered frame_size bytes (the largest frame accepted, with the vnet header when vnet), until
 * max_reads reads were made, the fd says EAGAIN, EOF, an error, or buf/slots have no room for
 * another read. With vnet, the 12-byte header is stripped (the slot points past it, csum_ok
 * from its flags), and a read of the header alone (or less) is skipped. *nslots: slots filled;
 * *reads: reads made (counted against max_reads, skipped ones included). With udp (not NULL),
 * a frame of an adopted UDP flow is moved to its host socket (dp_udp_guest, at time now) and
 * takes no slot. */
struct dp_udp_table;
enum dp_read_end dp_tap_read(int fd, uint8_t *buf, size_t cap, size_t frame_size, int vnet, unsigned max_reads,
                             struct dp_slot *slots, unsigned max_slots, unsigned *nslots, unsigned *reads, int *err,
                             struct dp_udp_table *udp, double now);

/* ---- UDP, host -> guest (the native UDP flows' output; sans-IO) ----
 *
 * dp_udp_frames() writes the Ethernet frames that carry one datagram from the host to the guest
 * into out[0..cap), one after another, and their places into slots: the IPv4 or IPv6 packet
 * (UDP checksum over the pseudo-header, a computed 0 sent as 0xFFFF; IPv4 with identification
 * ident4, DF clear, TTL hlim; IPv6 with hop limit hlim) behind the 14-byte header eth, fragmented
 * to mtu as the Python path does (aioslirp.wire.ipv4.fragment: fragments of (mtu - 20) & ~7
 * bytes; aioslirp.wire.ipv6.fragment6: a Fragment header with identification ident6, pieces of
 * (mtu - 48) & ~7 bytes). v6: addresses of 16 bytes (else 4). Returns the number of frames, or
 * -1 when out or slots are too small or the datagram or the MTU is out of range (payload at
 * most 65,507 bytes for IPv4, 65,527 for IPv6; mtu at least 68 / 1280). */
int dp_udp_frames(uint8_t *out, size_t cap, struct dp_slot *slots, unsigned max_slots, const uint8_t eth[14], int v6,
                  const uint8_t *src, const uint8_t *dst, uint16_t sport, uint16_t dport, const uint8_t *payload,
                  size_t plen, uint8_t hlim, unsigned mtu, uint16_t ident4, uint32_t ident6);

/* The bytes out[] needs for dp_udp_frames() (and the frames, in *nframes), or 0 when out of range. */
size_t dp_udp_frames_size(int v6, size_t plen, unsigned mtu, unsigned *nframes);

/* ---- UDP, guest -> host ----
 *
 * The checksum rule of the Python dispatch (aioslirp.dispatch.l4.L4.udp) for a UDP datagram
 * udp[0..ulen) (header included, ulen from its length field) between src and dst: 1 when valid,
 * or trusted (the guest kernel flagged it), or 0 over IPv4 (no checksum); 0 otherwise, and a
 * zero checksum over IPv6 is invalid (RFC 8200 8.1). */
int dp_udp_checksum_ok(int v6, const uint8_t *src, const uint8_t *dst, const uint8_t *udp, size_t ulen, int trusted);

/* ---- native UDP flows (IPv4): a flow Python admitted, its datagrams moved in C ----
 *
 * Python admits a flow (policy, limits, the connected host socket) and hands it to the table
 * (dp_udp_adopt). Then a guest frame of that flow, read by the TAP reader, goes to the host
 * socket from C (dp_udp_guest: the 5-tuple, the guest's MAC and the UDP checksum must match,
 * else the frame goes to Python as before), and host datagrams become guest frames in C
 * (dp_udp_host: recv until EAGAIN, dp_udp_frames, write to the TAP). Per flow, the table keeps
 * what Python's flow keeps (datagrams and bytes each way, the last activity, the guest's last IP
 * header + 8 bytes for ICMP errors, the last socket error) and which flows a read touched, for
 * Python to take in one batch (dp_udp_touched). Fixed capacity, no allocation after init. */
#define DP_UDP_HDR_MAX 68u /* a 60-byte IPv4 header + 8 */

struct dp_udp_flow {
    int fd;                 /* the connected host socket; -1: a free slot */
    int err;                /* the last host socket error (errno), 0 none; taken by Python */
    uint8_t guest_ip[4], remote_ip[4];
    uint16_t guest_port, remote_port;
    uint8_t eth[14];        /* frames to the guest: the guest's MAC, the gateway's, EtherType */
    uint8_t hlim;
    uint8_t touched;        /* in the touched list since Python last took it */
    uint8_t last_hdr_len;
    uint8_t last_hdr[DP_UDP_HDR_MAX];
    uint32_t mtu;
    int32_t next;           /* hash chain / free list */
    uint64_t up_datagrams, up_bytes, down_datagrams, down_bytes, blocked;
    uint64_t down_taken;    /* down_bytes when Python last took the flow's figures (udp_touched) */
    double last_active;     /* the caller's clock (loop time) of the last datagram either way */
};

struct dp_udp_table {
    struct dp_udp_flow *flows;
    int32_t *heads;          /* hash buckets, nbuckets a power of two */
    uint32_t cap, nbuckets, count;
    int32_t free_head;
    uint32_t *touched;       /* slots touched since dp_udp_touched(), at most cap */
    uint32_t ntouched;
    uint16_t ident;          /* IPv4 identification of the datagrams we send */
    uint64_t taken_frames, taken_bytes;  /* guest frames consumed, since Python took them */
    uint8_t attention;       /* a guest datagram's send failed or was refused (EAGAIN) since then */
};

/* The bytes a table of cap flows needs in each array (the caller allocates them). */
void dp_udp_init(struct dp_udp_table *t, struct dp_udp_flow *flows, int32_t *heads, uint32_t nbuckets,
                 uint32_t *touched, uint32_t cap, uint16_t ident);
/* Adopt a flow: returns its slot, or -1 (table full, or that 5-tuple is there already). */
int dp_udp_adopt(struct dp_udp_table *t, int fd, const uint8_t guest_ip[4], uint16_t guest_port,
                 const uint8_t remote_ip[4], uint16_t remote_port, const uint8_t eth[14], uint8_t hlim, uint32_t mtu,
                 double now);
/* Forget a slot (the caller closes the socket). Returns 0, or -1 for a slot not in use. */
int dp_udp_release(struct dp_udp_table *t, int slot);
/* A guest frame (no vnet header) read at now: 1 when it was an adopted flow's datagram, sent to
 * its host socket (or dropped there, counted in the flow: EAGAIN, an error kept in err); 0 when
 * it is not one (the caller hands it to Python). */
int dp_udp_guest(struct dp_udp_table *t, const uint8_t *frame, size_t len, int csum_ok, double now);
/* Host datagrams of slot: received DP_UDP_RECV_BATCH at a time (recvmmsg) until a call gets fewer
 * (the socket drained) or 64 moved, each written to tap_fd as guest frames (with a zero
 * virtio-net header when vnet); scratch (cap bytes, at least DP_UDP_SCRATCH) holds the
 * datagrams of one call and the frames of one of them. The flow's MTU must be at least 576 (at most 119 fragments).
 * Returns the datagrams moved (counted in the flow), or -1 for a slot not in use; adds the frames
 * written and their bytes (without the vnet header, as Python counts) to frames_out and bytes_out,
 * and the frames the TAP refused to write_errors. */
#define DP_UDP_RECV_BATCH 2u /* datagrams per recvmmsg(): one more than a request-response needs, so
                                 * that a call that got fewer has drained the socket (no EAGAIN call) */
#define DP_UDP_SCRATCH (DP_UDP_RECV_BATCH * 65536u + 65536u + 128u * 64u)
int dp_udp_host(struct dp_udp_table *t, int slot, int tap_fd, int vnet, double now, uint8_t *scratch, size_t cap,
                uint64_t *frames_out, uint64_t *bytes_out, uint64_t *write_errors);

/* ---- the SYN lane: a new guest connection to Python's admission without its dispatch ----
 *
 * A guest SYN that no native flow took goes to Python for admission (policy, limits, audit).
 * The Python path would parse it again from the Ethernet header up (aioslirp.dispatch: link,
 * ipv4/ipv6, l4), which costs more per connection than all the C of the flow's life. For the
 * plainest SYN, dp_syn_lane() says it may skip that: what the dispatch's parse would find is in
 * the record and in *out, and every check the dispatch makes before its admission that a plain
 * SYN can fail is one this function made (Python still makes those that need its state: the
 * guest's source address, a flow of the 5-tuple). 1 when the frame in buf[0..len) (no virtio-net
 * header; rec from dp_classify() of it) is one: a TCP segment whose flags (the 6 low bits) are
 * SYN alone, no payload, both ports non-zero, its checksum valid or trusted (csum_ok: the guest
 * kernel flagged it), its options as aioslirp.wire.tcp.parse_segment() reads them (MSS kind 2
 * length 4, window scale 3/3, SACK-permitted 4/2; the classifier checked the list's shape).
 * Anything else: 0, and the frame takes the full Python path, which decides as it always did. */
struct dp_syn {
    uint32_t seq;
    uint16_t wnd;   /* the window field (never scaled on a SYN) */
    int32_t mss;    /* -1: no MSS option */
    int16_t wscale; /* -1: no window scale option */
    uint8_t sack;   /* SACK-permitted */
};
int dp_syn_lane(const uint8_t *buf, size_t len, const struct dp_frame *rec, int csum_ok, struct dp_syn *out);

/* A guest frame that Python makes into a TCP segment only later (IPv4 fragments, which it
 * reassembles; IPv6 with an extension header, which it walks): the segments after it in the same
 * read go to Python too, in order, so that none of a native flow's passes it to the engine (which
 * drops what comes out of order). Rare; a plain frame is never diverted. The TAP reader
 * (read_batch) and the vhost-user TX walk (device_tx) both divert. */
static inline int dp_reorders_later(const uint8_t *p, size_t len)
{
    if (len < DP_ETH_HLEN + 20u)
        return 0; /* (too short for either: Python drops it anyway) */
    uint16_t type = (uint16_t)(p[12] << 8 | p[13]);
    const uint8_t *ip = p + DP_ETH_HLEN;
    if (type == 0x0800) /* (a last fragment may carry 8 bytes: a 42-byte frame) */
        return ((ip[6] << 8 | ip[7]) & 0x3FFF) != 0; /* more fragments, or an offset */
    if (type == 0x86DD && len >= DP_ETH_HLEN + 40u) {
        uint8_t nh = ip[6];
        return nh == 0 || nh == 43 || nh == 44 || nh == 50 || nh == 51 || nh == 60 || nh == 135 || nh == 139 ||
               nh == 140;
    }
    return 0;
}

#endif
