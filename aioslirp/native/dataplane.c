/* aioslirp's native data plane, the C core: the frame classifier and the TAP batch reader.
 * See dataplane.h for the contract. MIT licensed, written for aioslirp. */
#define _GNU_SOURCE
#include "dataplane.h"

#include <errno.h>
#include <string.h>
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
                             struct dp_slot *slots, unsigned max_slots, unsigned *nslots, unsigned *reads, int *err)
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
