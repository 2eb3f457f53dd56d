/* aioslirp's native data plane, the C core: the frame classifier and the TAP batch reader.
 * See dataplane.h for the contract. MIT licensed, written for aioslirp. */
#define _GNU_SOURCE
#include "dataplane.h"

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define ETHERTYPE_IPV4 0x0800u
#define ETHERTYPE_ARP 0x0806u
#define ETHERTYPE_IPV6 0x86DDu
#define PROTO_ICMP 1u
#define PROTO_TCP 6u
#define PROTO_UDP 17u
#define PROTO_ICMPV6 58u
#define NH_NONE 59u
#define IPV4_MF 0x2000u
#define IPV4_OFFMASK 0x1FFFu
#define VNET_NEEDS_CSUM 1u
#define VNET_DATA_VALID 2u

static const char *const reason_names[DP_R_COUNT] = {
    [DP_R_NONE] = "",
    [DP_R_TRUNCATED_VNET] = "truncated_vnet",
    [DP_R_TRUNCATED_ETH] = "truncated_eth",
    [DP_R_BAD_SRC_MAC] = "bad_src_mac",
    [DP_R_UNKNOWN_ETHERTYPE] = "unknown_ethertype",
    [DP_R_TRUNCATED_IP] = "truncated_ip",
    [DP_R_BAD_IP_HEADER] = "bad_ip_header",
    [DP_R_BAD_IP_LENGTH] = "bad_ip_length",
    [DP_R_BAD_IP_CHECKSUM] = "bad_ip_checksum",
    [DP_R_UNKNOWN_IP_PROTO] = "unknown_ip_proto",
    [DP_R_IPV6_TRUNCATED] = "ipv6_truncated",
    [DP_R_IPV6_BAD_VERSION] = "ipv6_bad_version",
    [DP_R_IPV6_JUMBOGRAM] = "ipv6_jumbogram",
    [DP_R_IPV6_BAD_LENGTH] = "ipv6_bad_length",
    [DP_R_IPV6_BAD_SRC] = "ipv6_bad_src",
    [DP_R_TRUNCATED_TCP] = "truncated_tcp",
    [DP_R_BAD_TCP_HEADER] = "bad_tcp_header",
    [DP_R_TRUNCATED_UDP] = "truncated_udp",
    [DP_R_BAD_UDP_LENGTH] = "bad_udp_length",
    [DP_R_ARP] = "arp",
    [DP_R_ICMP] = "icmp",
    [DP_R_FRAGMENT] = "fragment",
    [DP_R_IPV6_EXT] = "ipv6_ext",
};

const char *dp_reason_name(unsigned reason)
{
    return reason < DP_R_COUNT ? reason_names[reason] : NULL;
}

const char *dp_reason_name6(unsigned reason)
{
    switch (reason) {
    case DP_R_TRUNCATED_TCP:
        return "tcp6_truncated";
    case DP_R_TRUNCATED_UDP:
        return "udp6_truncated";
    case DP_R_BAD_UDP_LENGTH:
        return "udp6_bad_length";
    default:
        return dp_reason_name(reason);
    }
}

static inline uint16_t rd16(const uint8_t *p)
{
    return (uint16_t)((p[0] << 8) | p[1]);
}

static inline uint32_t rd32(const uint8_t *p)
{
    return ((uint32_t)rd16(p) << 16) | rd16(p + 2);
}

/* The IPv4 header checksum holds when the folded one's-complement sum of the header is 0xFFFF
 * (or 0, the other zero; aioslirp.wire.checksum.partial() == 0 says the same). n is even. */
static int ipv4_header_sum_ok(const uint8_t *p, size_t n)
{
    uint32_t s = 0;
    for (size_t i = 0; i < n; i += 2)
        s += rd16(p + i);
    while (s >> 16)
        s = (s & 0xFFFFu) + (s >> 16);
    return s == 0xFFFFu || s == 0;
}

static int finish(struct dp_frame *f, struct dp_counters *c, enum dp_kind kind, enum dp_reason reason)
{
    f->kind = (uint8_t)kind;
    f->reason = (uint8_t)reason;
    if (c) {
        c->frames++;
        c->by_reason[reason]++;
    }
    return kind;
}

/* TCP at buf[l4, end): data offset and options (what aioslirp.wire.tcp.parse_segment checks). */
static int classify_tcp(const uint8_t *buf, size_t l4, size_t end, struct dp_frame *f, struct dp_counters *c)
{
    size_t n = end - l4;
    if (n < 20)
        return finish(f, c, DP_KIND_DROP, DP_R_TRUNCATED_TCP);
    const uint8_t *t = buf + l4;
    size_t doff = (size_t)(t[12] >> 4) << 2;
    if (doff < 20 || doff > n)
        return finish(f, c, DP_KIND_DROP, DP_R_BAD_TCP_HEADER);
    for (size_t i = 20; i < doff;) { /* doff <= 60: at most 40 option bytes */
        uint8_t kind = t[i];
        if (kind == 0) /* End of Option List */
            break;
        if (kind == 1) { /* NOP */
            i++;
            continue;
        }
        if (i + 1 >= doff)
            return finish(f, c, DP_KIND_DROP, DP_R_BAD_TCP_HEADER);
        size_t olen = t[i + 1];
        if (olen < 2 || i + olen > doff)
            return finish(f, c, DP_KIND_DROP, DP_R_BAD_TCP_HEADER);
        i += olen;
    }
    f->sport = rd16(t);
    f->dport = rd16(t + 2);
    f->tcp_flags = t[13] & 0x3Fu;
    f->l4_off = (uint32_t)l4;
    f->payload_off = (uint32_t)(l4 + doff);
    f->payload_len = (uint32_t)(n - doff);
    return finish(f, c, DP_KIND_TCP, DP_R_NONE);
}

/* UDP at buf[l4, end): the length field against the packet. */
static int classify_udp(const uint8_t *buf, size_t l4, size_t end, struct dp_frame *f, struct dp_counters *c)
{
    size_t n = end - l4;
    if (n < 8)
        return finish(f, c, DP_KIND_DROP, DP_R_TRUNCATED_UDP);
    const uint8_t *u = buf + l4;
    size_t ulen = rd16(u + 4);
    if (ulen < 8 || ulen > n)
        return finish(f, c, DP_KIND_DROP, DP_R_BAD_UDP_LENGTH);
    f->sport = rd16(u);
    f->dport = rd16(u + 2);
    f->l4_off = (uint32_t)l4;
    f->payload_off = (uint32_t)(l4 + 8);
    f->payload_len = (uint32_t)(ulen - 8); /* bytes past the UDP length (to end) are not payload */
    return finish(f, c, DP_KIND_UDP, DP_R_NONE);
}

static int classify_ipv4(const uint8_t *buf, size_t len, size_t l3, struct dp_frame *f, struct dp_counters *c)
{
    if (len < l3 + 20)
        return finish(f, c, DP_KIND_DROP, DP_R_TRUNCATED_IP);
    const uint8_t *ip = buf + l3;
    size_t ihl = (size_t)(ip[0] & 0x0Fu) << 2;
    if ((ip[0] >> 4) != 4 || ihl < 20)
        return finish(f, c, DP_KIND_DROP, DP_R_BAD_IP_HEADER);
    size_t total = rd16(ip + 2);
    if (total < ihl || l3 + total > len)
        return finish(f, c, DP_KIND_DROP, DP_R_BAD_IP_LENGTH);
    if (!ipv4_header_sum_ok(ip, ihl))
        return finish(f, c, DP_KIND_DROP, DP_R_BAD_IP_CHECKSUM);
    f->proto = ip[9];
    memcpy(f->src, ip + 12, 4);
    memcpy(f->dst, ip + 16, 4);
    f->end = (uint32_t)(l3 + total);
    f->l4_off = (uint32_t)(l3 + ihl);
    if (rd16(ip + 6) & (IPV4_MF | IPV4_OFFMASK))
        return finish(f, c, DP_KIND_NOT_NATIVE, DP_R_FRAGMENT);
    switch (ip[9]) {
    case PROTO_TCP:
        return classify_tcp(buf, l3 + ihl, l3 + total, f, c);
    case PROTO_UDP:
        return classify_udp(buf, l3 + ihl, l3 + total, f, c);
    case PROTO_ICMP:
        return finish(f, c, DP_KIND_NOT_NATIVE, DP_R_ICMP);
    default:
        return finish(f, c, DP_KIND_DROP, DP_R_UNKNOWN_IP_PROTO);
    }
}

static int classify_ipv6(const uint8_t *buf, size_t len, size_t l3, struct dp_frame *f, struct dp_counters *c)
{
    if (len < l3 + 40)
        return finish(f, c, DP_KIND_DROP, DP_R_IPV6_TRUNCATED);
    const uint8_t *ip = buf + l3;
    if ((ip[0] >> 4) != 6)
        return finish(f, c, DP_KIND_DROP, DP_R_IPV6_BAD_VERSION);
    size_t plen = rd16(ip + 4);
    uint8_t nh = ip[6];
    if (plen == 0 && nh != NH_NONE)
        return finish(f, c, DP_KIND_DROP, DP_R_IPV6_JUMBOGRAM);
    if (l3 + 40 + plen > len)
        return finish(f, c, DP_KIND_DROP, DP_R_IPV6_BAD_LENGTH);
    if (ip[8] == 0xFF)
        return finish(f, c, DP_KIND_DROP, DP_R_IPV6_BAD_SRC);
    f->flags |= DP_F_IPV6;
    f->proto = nh;
    memcpy(f->src, ip + 8, 16);
    memcpy(f->dst, ip + 24, 16);
    f->end = (uint32_t)(l3 + 40 + plen);
    f->l4_off = (uint32_t)(l3 + 40);
    switch (nh) {
    case PROTO_TCP:
        return classify_tcp(buf, l3 + 40, l3 + 40 + plen, f, c);
    case PROTO_UDP:
        return classify_udp(buf, l3 + 40, l3 + 40 + plen, f, c);
    case PROTO_ICMPV6:
        return finish(f, c, DP_KIND_NOT_NATIVE, DP_R_ICMP);
    default: /* extension headers (walked in Python), No Next Header, others */
        return finish(f, c, DP_KIND_NOT_NATIVE, DP_R_IPV6_EXT);
    }
}

int dp_classify(const uint8_t *buf, size_t len, int vnet, struct dp_frame *f, struct dp_counters *c)
{
    memset(f, 0, sizeof *f);
    size_t l2 = 0;
    if (vnet) {
        f->flags |= DP_F_VNET;
        if (len <= DP_VNET_HDR_LEN)
            return finish(f, c, DP_KIND_DROP, DP_R_TRUNCATED_VNET);
        if (buf[0] & (VNET_NEEDS_CSUM | VNET_DATA_VALID))
            f->flags |= DP_F_CSUM_OK;
        l2 = DP_VNET_HDR_LEN;
    }
    f->l2_off = (uint32_t)l2;
    if (len < l2 + DP_ETH_HLEN)
        return finish(f, c, DP_KIND_DROP, DP_R_TRUNCATED_ETH);
    const uint8_t *eth = buf + l2;
    if (eth[6] & 1)
        return finish(f, c, DP_KIND_DROP, DP_R_BAD_SRC_MAC);
    uint16_t et = rd16(eth + 12);
    f->ethertype = et;
    size_t l3 = l2 + DP_ETH_HLEN;
    f->l3_off = (uint32_t)l3;
    switch (et) {
    case ETHERTYPE_IPV4:
        return classify_ipv4(buf, len, l3, f, c);
    case ETHERTYPE_IPV6:
        return classify_ipv6(buf, len, l3, f, c);
    case ETHERTYPE_ARP:
        return finish(f, c, DP_KIND_NOT_NATIVE, DP_R_ARP);
    default:
        return finish(f, c, DP_KIND_DROP, DP_R_UNKNOWN_ETHERTYPE);
    }
}

enum dp_read_end dp_tap_read(int fd, uint8_t *buf, size_t cap, size_t frame_size, int vnet, unsigned max_reads,
                             struct dp_slot *slots, unsigned max_slots, unsigned *nslots, unsigned *reads, int *err,
                             struct dp_udp_table *udp, double now)
{
    size_t used = 0;
    unsigned n = 0, r = 0;
    enum dp_read_end end = DP_READ_DONE;
    *err = 0;
    while (r < max_reads) {
        if (n == max_slots || cap - used < frame_size) {
            end = DP_READ_FULL;
            break;
        }
        ssize_t got = read(fd, buf + used, frame_size);
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
                end = DP_READ_AGAIN;
            } else {
                *err = errno;
                end = DP_READ_ERROR;
            }
            break;
        }
        r++;
        if (got == 0) {
            end = DP_READ_EOF;
            break;
        }
        size_t off = used, flen = (size_t)got;
        uint8_t csum_ok = 0;
        if (vnet) {
            if (flen <= DP_VNET_HDR_LEN) /* a header without a frame: nothing to deliver */
                continue;
            csum_ok = (buf[used] & (VNET_NEEDS_CSUM | VNET_DATA_VALID)) != 0;
            off += DP_VNET_HDR_LEN;
            flen -= DP_VNET_HDR_LEN;
        }
        if (udp && udp->count && dp_udp_guest(udp, buf + off, flen, csum_ok, now))
            continue; /* moved by a native UDP flow: its buffer space is reused */
        slots[n].off = (uint32_t)off;
        slots[n].len = (uint32_t)flen;
        slots[n].csum_ok = csum_ok;
        n++;
        used += (size_t)got;
    }
    *nslots = n;
    *reads = r;
    return end;
}

/* ---- checksums (RFC 1071), as aioslirp.wire.checksum computes them ---- */

/* The sum of the 16-bit big-endian words of p[0..n) (an odd last byte padded with 0), unreduced. */
static uint64_t sum_words(const uint8_t *p, size_t n)
{
    uint64_t s = 0;
    size_t i = 0;
    for (; i + 1 < n; i += 2)
        s += rd16(p + i);
    if (i < n)
        s += (uint64_t)p[i] << 8;
    return s;
}

/* aioslirp.wire.checksum.finish(): the field value for a sum (0 when the sum is 0 mod 0xFFFF). */
static uint16_t finish_sum(uint64_t s)
{
    s %= 0xFFFFu;
    return (uint16_t)(s ? 0xFFFFu - s : 0);
}

static inline void wr16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}

static inline void wr32(uint8_t *p, uint32_t v)
{
    wr16(p, (uint16_t)(v >> 16));
    wr16(p + 2, (uint16_t)v);
}

int dp_udp_checksum_ok(int v6, const uint8_t *src, const uint8_t *dst, const uint8_t *udp, size_t ulen, int trusted)
{
    if (trusted)
        return 1;
    if (udp[6] == 0 && udp[7] == 0)
        return !v6;
    size_t alen = v6 ? 16 : 4;
    uint64_t s = sum_words(src, alen) + sum_words(dst, alen) + PROTO_UDP + ulen + sum_words(udp, ulen);
    return s % 0xFFFFu == 0;
}

int dp_syn_lane(const uint8_t *buf, size_t len, const struct dp_frame *rec, int csum_ok, struct dp_syn *out)
{
    if (rec->kind != DP_KIND_TCP || rec->tcp_flags != 0x02u || rec->payload_len || !rec->sport || !rec->dport)
        return 0;
    /* the record's offsets were checked by dp_classify() against the buffer it read: again, cheaply */
    if (rec->end > len || rec->l4_off + 20u > rec->end || rec->payload_off > rec->end)
        return 0;
    const uint8_t *t = buf + rec->l4_off;
    size_t tlen = rec->end - rec->l4_off, doff = rec->payload_off - rec->l4_off;
    if (!csum_ok) { /* aioslirp.dispatch.l4.L4.tcp: the pseudo-header sum and the segment's, 0 mod 0xFFFF */
        int v6 = (rec->flags & DP_F_IPV6) != 0;
        size_t alen = v6 ? 16 : 4;
        uint64_t s = sum_words(rec->src, alen) + sum_words(rec->dst, alen) + PROTO_TCP + tlen + sum_words(t, tlen);
        if (s % 0xFFFFu != 0)
            return 0;
    }
    out->seq = rd32(t + 4);
    out->wnd = (uint16_t)rd16(t + 14);
    out->mss = -1;
    out->wscale = -1;
    out->sack = 0;
    for (size_t i = 20; i < doff;) { /* the shape was checked by classify_tcp(): same walk, values read */
        uint8_t kind = t[i];
        if (kind == 0)
            break;
        if (kind == 1) {
            i++;
            continue;
        }
        if (i + 1 >= doff)
            return 0;
        size_t olen = t[i + 1];
        if (olen < 2 || i + olen > doff)
            return 0;
        if (kind == 2 && olen == 4)
            out->mss = (int32_t)rd16(t + i + 2);
        else if (kind == 3 && olen == 3)
            out->wscale = t[i + 2];
        else if (kind == 4 && olen == 2)
            out->sack = 1;
        i += olen;
    }
    return 1;
}

/* The IPv4 header (20 bytes, no options) at p, with its checksum. */
static void ipv4_header(uint8_t *p, const uint8_t *src, const uint8_t *dst, size_t total, uint16_t ident,
                        uint16_t flags_frag, uint8_t ttl)
{
    p[0] = 0x45;
    p[1] = 0;
    wr16(p + 2, (uint16_t)total);
    wr16(p + 4, ident);
    wr16(p + 6, flags_frag);
    p[8] = ttl;
    p[9] = PROTO_UDP;
    p[10] = p[11] = 0;
    memcpy(p + 12, src, 4);
    memcpy(p + 16, dst, 4);
    wr16(p + 10, finish_sum(sum_words(p, 20)));
}

static void ipv6_header(uint8_t *p, const uint8_t *src, const uint8_t *dst, size_t plen, uint8_t nh, uint8_t hlim)
{
    wr32(p, 6u << 28);
    wr16(p + 4, (uint16_t)plen);
    p[6] = nh;
    p[7] = hlim;
    memcpy(p + 8, src, 16);
    memcpy(p + 24, dst, 16);
}

size_t dp_udp_frames_size(int v6, size_t plen, unsigned mtu, unsigned *nframes)
{
    size_t ip_hlen = v6 ? 40 : 20, ulen = 8 + plen, total = ip_hlen + ulen;
    if (plen > (v6 ? 65527u : 65507u) || mtu < (v6 ? 1280u : 68u) || mtu > 65535u)
        return 0;
    if (total <= mtu) {
        *nframes = 1;
        return DP_ETH_HLEN + total;
    }
    size_t step = v6 ? ((mtu - 48) & ~(size_t)7) : ((mtu - 20) & ~(size_t)7);
    size_t n = (ulen + step - 1) / step;
    *nframes = (unsigned)n;
    return n * (DP_ETH_HLEN + ip_hlen + (v6 ? 8 : 0)) + ulen;
}

int dp_udp_frames(uint8_t *out, size_t cap, struct dp_slot *slots, unsigned max_slots, const uint8_t eth[14], int v6,
                  const uint8_t *src, const uint8_t *dst, uint16_t sport, uint16_t dport, const uint8_t *payload,
                  size_t plen, uint8_t hlim, unsigned mtu, uint16_t ident4, uint32_t ident6)
{
    unsigned n;
    size_t need = dp_udp_frames_size(v6, plen, mtu, &n);
    if (!need || need > cap || n > max_slots)
        return -1;
    size_t ip_hlen = v6 ? 40 : 20, ulen = 8 + plen, alen = v6 ? 16 : 4;
    /* The UDP header's checksum over the whole datagram, before any fragmenting. */
    uint8_t uh[8];
    wr16(uh, sport);
    wr16(uh + 2, dport);
    wr16(uh + 4, (uint16_t)ulen);
    uh[6] = uh[7] = 0;
    uint64_t s = sum_words(src, alen) + sum_words(dst, alen) + PROTO_UDP + ulen + sum_words(uh, 8);
    /* the payload starts at an even offset (8): its words continue the header's */
    s += sum_words(payload, plen);
    uint16_t csum = finish_sum(s);
    wr16(uh + 6, csum ? csum : 0xFFFFu);
    if (n == 1) {
        memcpy(out, eth, DP_ETH_HLEN);
        uint8_t *ip = out + DP_ETH_HLEN;
        if (v6)
            ipv6_header(ip, src, dst, ulen, PROTO_UDP, hlim);
        else
            ipv4_header(ip, src, dst, ip_hlen + ulen, ident4, 0, hlim);
        memcpy(ip + ip_hlen, uh, 8);
        memcpy(ip + ip_hlen + 8, payload, plen);
        slots[0].off = 0;
        slots[0].len = (uint32_t)(DP_ETH_HLEN + ip_hlen + ulen);
        slots[0].csum_ok = 0;
        return 1;
    }
    size_t step = v6 ? ((mtu - 48) & ~(size_t)7) : ((mtu - 20) & ~(size_t)7);
    size_t used = 0;
    for (unsigned i = 0; i < n; i++) {
        size_t off = (size_t)i * step, chunk = ulen - off < step ? ulen - off : step;
        int more = off + chunk < ulen;
        uint8_t *f = out + used, *ip = f + DP_ETH_HLEN, *data;
        memcpy(f, eth, DP_ETH_HLEN);
        if (v6) {
            ipv6_header(ip, src, dst, 8 + chunk, 44, hlim);
            ip[40] = PROTO_UDP;
            ip[41] = 0;
            wr16(ip + 42, (uint16_t)(off | (more ? 1u : 0u)));
            wr32(ip + 44, ident6);
            data = ip + 48;
        } else {
            ipv4_header(ip, src, dst, 20 + chunk, ident4, (uint16_t)((more ? 0x2000u : 0u) | (off >> 3)), hlim);
            data = ip + 20;
        }
        /* the datagram's bytes [off, off + chunk): the 8-byte UDP header, then the payload */
        size_t k = 0;
        for (; off + k < 8 && k < chunk; k++)
            data[k] = uh[off + k];
        if (k < chunk)
            memcpy(data + k, payload + (off + k - 8), chunk - k);
        size_t flen = (size_t)(data - f) + chunk;
        slots[i].off = (uint32_t)used;
        slots[i].len = (uint32_t)flen;
        slots[i].csum_ok = 0;
        used += flen;
    }
    return (int)n;
}

/* ---- native UDP flows (IPv4) ---- */

static uint32_t flow_hash(const uint8_t gip[4], uint16_t gport, const uint8_t rip[4], uint16_t rport)
{
    uint8_t k[12];
    memcpy(k, gip, 4);
    memcpy(k + 4, rip, 4);
    k[8] = (uint8_t)(gport >> 8), k[9] = (uint8_t)gport, k[10] = (uint8_t)(rport >> 8), k[11] = (uint8_t)rport;
    uint32_t h = 2166136261u; /* FNV-1a */
    for (int i = 0; i < 12; i++)
        h = (h ^ k[i]) * 16777619u;
    return h;
}

void dp_udp_init(struct dp_udp_table *t, struct dp_udp_flow *flows, int32_t *heads, uint32_t nbuckets,
                 uint32_t *touched, uint32_t cap, uint16_t ident)
{
    memset(t, 0, sizeof *t);
    t->flows = flows;
    t->heads = heads;
    t->nbuckets = nbuckets;
    t->touched = touched;
    t->cap = cap;
    t->ident = ident;
    for (uint32_t i = 0; i < nbuckets; i++)
        heads[i] = -1;
    for (uint32_t i = 0; i < cap; i++) {
        memset(&flows[i], 0, sizeof flows[i]);
        flows[i].fd = -1;
        flows[i].next = i + 1 < cap ? (int32_t)(i + 1) : -1;
    }
    t->free_head = cap ? 0 : -1;
}

static int lookup(const struct dp_udp_table *t, const uint8_t gip[4], uint16_t gport, const uint8_t rip[4],
                  uint16_t rport)
{
    for (int32_t i = t->heads[flow_hash(gip, gport, rip, rport) & (t->nbuckets - 1)]; i >= 0; i = t->flows[i].next) {
        const struct dp_udp_flow *f = &t->flows[i];
        if (f->guest_port == gport && f->remote_port == rport && !memcmp(f->guest_ip, gip, 4) &&
            !memcmp(f->remote_ip, rip, 4))
            return i;
    }
    return -1;
}

int dp_udp_adopt(struct dp_udp_table *t, int fd, const uint8_t guest_ip[4], uint16_t guest_port,
                 const uint8_t remote_ip[4], uint16_t remote_port, const uint8_t eth[14], uint8_t hlim, uint32_t mtu,
                 double now)
{
    if (fd < 0 || t->free_head < 0 || lookup(t, guest_ip, guest_port, remote_ip, remote_port) >= 0)
        return -1;
    int32_t i = t->free_head;
    struct dp_udp_flow *f = &t->flows[i];
    t->free_head = f->next;
    memset(f, 0, sizeof *f);
    f->fd = fd;
    memcpy(f->guest_ip, guest_ip, 4);
    memcpy(f->remote_ip, remote_ip, 4);
    f->guest_port = guest_port;
    f->remote_port = remote_port;
    memcpy(f->eth, eth, 14);
    f->hlim = hlim;
    f->mtu = mtu;
    f->last_active = now;
    uint32_t b = flow_hash(guest_ip, guest_port, remote_ip, remote_port) & (t->nbuckets - 1);
    f->next = t->heads[b];
    t->heads[b] = i;
    t->count++;
    return i;
}

int dp_udp_release(struct dp_udp_table *t, int slot)
{
    if (slot < 0 || (uint32_t)slot >= t->cap || t->flows[slot].fd < 0)
        return -1;
    struct dp_udp_flow *f = &t->flows[slot];
    int32_t *link = &t->heads[flow_hash(f->guest_ip, f->guest_port, f->remote_ip, f->remote_port) & (t->nbuckets - 1)];
    while (*link != slot)
        link = &t->flows[*link].next;
    *link = f->next;
    if (f->touched) { /* out of the touched list */
        for (uint32_t k = 0; k < t->ntouched; k++) {
            if (t->touched[k] == (uint32_t)slot) {
                t->touched[k] = t->touched[--t->ntouched];
                break;
            }
        }
    }
    memset(f, 0, sizeof *f);
    f->fd = -1;
    f->next = t->free_head;
    t->free_head = slot;
    t->count--;
    return 0;
}

static void touch(struct dp_udp_table *t, struct dp_udp_flow *f)
{
    if (!f->touched) {
        f->touched = 1;
        t->touched[t->ntouched++] = (uint32_t)(f - t->flows);
    }
}

int dp_udp_guest(struct dp_udp_table *t, const uint8_t *frame, size_t len, int csum_ok, double now)
{
    if (!t->count)
        return 0;
    struct dp_frame r;
    if (dp_classify(frame, len, 0, &r, NULL) != DP_KIND_UDP || (r.flags & DP_F_IPV6))
        return 0;
    int slot = lookup(t, r.src, r.sport, r.dst, r.dport);
    if (slot < 0)
        return 0;
    struct dp_udp_flow *f = &t->flows[slot];
    if (memcmp(frame + 6, f->eth, 6)) /* another source MAC: Python learns it */
        return 0;
    const uint8_t *udp = frame + r.l4_off;
    if (!dp_udp_checksum_ok(0, r.src, r.dst, udp, 8 + (size_t)r.payload_len, csum_ok))
        return 0; /* Python drops and counts it */
    size_t hl = r.l4_off - r.l3_off + 8; /* at most 60 + 8 */
    memcpy(f->last_hdr, frame + r.l3_off, hl);
    f->last_hdr_len = (uint8_t)hl;
    f->last_active = now;
    ssize_t sent = send(f->fd, frame + r.payload_off, r.payload_len, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent >= 0) {
        f->up_datagrams++;
        f->up_bytes += r.payload_len;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        f->blocked++;
        t->attention = 1;
    } else {
        f->err = errno;
        t->attention = 1;
    }
    touch(t, f);
    t->taken_frames++;
    t->taken_bytes += len;
    return 1;
}

int dp_udp_host(struct dp_udp_table *t, int slot, int tap_fd, int vnet, double now, uint8_t *scratch, size_t cap,
                uint64_t *frames_out, uint64_t *bytes_out, uint64_t *write_errors)
{
    static const uint8_t zero_vnet[DP_VNET_HDR_LEN];
    if (slot < 0 || (uint32_t)slot >= t->cap || t->flows[slot].fd < 0 || cap < DP_UDP_SCRATCH)
        return -1;
    struct dp_udp_flow *f = &t->flows[slot];
    struct dp_slot fs[128]; /* mtu >= 576 (dp_udp_adopt's caller): at most 119 fragments */
    uint8_t *frames = scratch + DP_UDP_RECV_BATCH * 65536u; /* one datagram's frames at a time */
    size_t frames_cap = cap - DP_UDP_RECV_BATCH * 65536u;
    struct iovec iov[DP_UDP_RECV_BATCH];
    struct mmsghdr mm[DP_UDP_RECV_BATCH];
    int moved = 0;
    while (moved < 64) {
        for (unsigned k = 0; k < DP_UDP_RECV_BATCH; k++) {
            iov[k].iov_base = scratch + k * 65536u;
            iov[k].iov_len = 65536;
            memset(&mm[k], 0, sizeof mm[k]);
            mm[k].msg_hdr.msg_iov = &iov[k];
            mm[k].msg_hdr.msg_iovlen = 1;
        }
        int got = recvmmsg(f->fd, mm, DP_UDP_RECV_BATCH, MSG_DONTWAIT, NULL);
        if (got < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                f->err = errno;
            break;
        }
        for (int d = 0; d < got; d++) {
            size_t n = mm[d].msg_len; /* at most 65536: a datagram longer than IPv4 carries is cut, then refused */
            f->last_active = now;
            f->down_datagrams++;
            f->down_bytes += (uint64_t)n;
            moved++;
            int nf = dp_udp_frames(frames, frames_cap, fs, 128, f->eth, 0, f->remote_ip, f->guest_ip, f->remote_port,
                                   f->guest_port, iov[d].iov_base, n, f->hlim, f->mtu, t->ident++, 0);
            if (nf < 0) { /* longer than an IPv4 datagram can carry: nothing to send */
                (*write_errors)++;
                continue;
            }
            for (int k = 0; k < nf; k++) {
                uint8_t *fr = frames + fs[k].off;
                ssize_t w;
                if (vnet) {
                    struct iovec v[2] = {{(void *)zero_vnet, DP_VNET_HDR_LEN}, {fr, fs[k].len}};
                    w = writev(tap_fd, v, 2);
                } else {
                    w = write(tap_fd, fr, fs[k].len);
                }
                if (w < 0) {
                    (*write_errors)++;
                } else {
                    (*frames_out)++;
                    *bytes_out += fs[k].len;
                }
            }
        }
        if (got > 0)
            touch(t, f); /* its figures for the next dp_udp_touched() */
        if (got < (int)DP_UDP_RECV_BATCH) /* fewer than asked: the socket is drained (no EAGAIN call) */
            break;
    }
    return moved;
}
