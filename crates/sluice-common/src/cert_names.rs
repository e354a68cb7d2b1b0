//! The names in an X.509 certificate that client-certificate authentication
//! maps to principals: the subject's common names and the DNS and URI
//! subject alternative names, read straight from the DER.
//!
//! Only certificates rustls has already verified reach this (the chain, the
//! signature and the DER encoding), so this reads the few fields it needs
//! and nothing else; anything it cannot read gives no names, which no
//! mapping matches. A general X.509 parser would bring eleven crates (and
//! their proc-macros) into every build for these fields.

/// DER tags used here.
const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
const OID: u8 = 0x06;
const OCTET_STRING: u8 = 0x04;
/// `[0]` EXPLICIT: the version in a TBSCertificate.
const VERSION: u8 = 0xa0;
/// `[3]` EXPLICIT: the extensions in a TBSCertificate.
const EXTENSIONS: u8 = 0xa3;
/// GeneralName `[2] dNSName` and `[6] uniformResourceIdentifier` (IMPLICIT
/// IA5String, primitive).
const DNS_NAME: u8 = 0x82;
const URI: u8 = 0x86;
/// The string types a common name comes in that read as text: UTF8String,
/// NumericString, PrintableString, TeletexString, IA5String, VisibleString.
const TEXT_STRINGS: [u8; 6] = [0x0c, 0x12, 0x13, 0x14, 0x16, 0x1a];
/// id-at-commonName, 2.5.4.3.
const COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];
/// id-ce-subjectAltName, 2.5.29.17.
const SUBJECT_ALT_NAME: &[u8] = &[0x55, 0x1d, 0x11];

/// A certificate's common names, then its DNS and URI subject alternative
/// names, in the order the certificate lists them; none if it cannot be read.
pub fn certificate_names(certificate: &[u8]) -> Vec<String> {
    names(certificate).unwrap_or_default()
}

fn names(certificate: &[u8]) -> Option<Vec<String>> {
    let (certificate, _) = expect(certificate, SEQUENCE)?;
    let (tbs, _) = expect(certificate, SEQUENCE)?;
    let mut fields = Elements(tbs);
    let (first_tag, _) = fields.next()?;
    if first_tag == VERSION {
        // Then the serial number.
        fields.next()?;
    }
    // The signature algorithm, the issuer and the validity.
    for _ in 0..3 {
        fields.next()?;
    }
    let (subject_tag, subject) = fields.next()?;
    if subject_tag != SEQUENCE {
        return None;
    }
    let mut names = Vec::new();
    for (set_tag, set) in Elements(subject) {
        if set_tag != SET {
            return None;
        }
        for (attribute_tag, attribute) in Elements(set) {
            if attribute_tag != SEQUENCE {
                return None;
            }
            let (oid, rest) = expect(attribute, OID)?;
            let (string_tag, value, _) = element(rest)?;
            if oid == COMMON_NAME && TEXT_STRINGS.contains(&string_tag) {
                if let Ok(name) = std::str::from_utf8(value) {
                    names.push(name.to_string());
                }
            }
        }
    }
    // The subject public key info, then optional unique IDs and extensions.
    fields.next()?;
    for (tag, extensions) in fields {
        if tag == EXTENSIONS {
            let (extensions, _) = expect(extensions, SEQUENCE)?;
            for (extension_tag, extension) in Elements(extensions) {
                if extension_tag != SEQUENCE {
                    return None;
                }
                let (oid, rest) = expect(extension, OID)?;
                if oid != SUBJECT_ALT_NAME {
                    continue;
                }
                // An optional `critical` BOOLEAN before the value.
                let value = Elements(rest).find(|(tag, _)| *tag == OCTET_STRING)?.1;
                let (general_names, _) = expect(value, SEQUENCE)?;
                for (name_tag, name) in Elements(general_names) {
                    if name_tag == DNS_NAME || name_tag == URI {
                        if let Ok(name) = std::str::from_utf8(name) {
                            names.push(name.to_string());
                        }
                    }
                }
            }
        }
    }
    Some(names)
}

/// One DER element: its tag, its contents and what follows it. Only
/// low-tag-number forms and definite lengths (DER has no other lengths).
fn element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    if tag & 0x1f == 0x1f {
        return None;
    }
    let (&first, mut rest) = rest.split_first()?;
    let length = if first < 0x80 {
        usize::from(first)
    } else {
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 {
            return None;
        }
        let (bytes, after) = rest.split_at_checked(count)?;
        rest = after;
        bytes
            .iter()
            .fold(0usize, |length, &byte| (length << 8) | usize::from(byte))
    };
    let (contents, rest) = rest.split_at_checked(length)?;
    Some((tag, contents, rest))
}

/// The contents of the element at the start of `input`, which must have
/// `tag`, and what follows it.
fn expect(input: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (found, contents, rest) = element(input)?;
    (found == tag).then_some((contents, rest))
}

/// The elements inside a constructed element's contents, in order; it stops
/// at the first that cannot be read.
struct Elements<'a>(&'a [u8]);

impl<'a> Iterator for Elements<'a> {
    type Item = (u8, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let (tag, contents, rest) = element(self.0)?;
        self.0 = rest;
        Some((tag, contents))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, DnType, KeyPair, SanType};

    fn certificate(common_name: Option<&str>, alternative: Vec<SanType>) -> Vec<u8> {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::OrganizationName, "Sluice tests");
        if let Some(name) = common_name {
            params.distinguished_name.push(DnType::CommonName, name);
        }
        params.distinguished_name.push(DnType::CountryName, "NL");
        params.subject_alt_names = alternative;
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn the_common_name_then_dns_and_uri_alternative_names_in_order() {
        let der = certificate(
            Some("worker-a"),
            vec![
                SanType::DnsName("worker-a.jobs.svc".try_into().unwrap()),
                SanType::IpAddress(std::net::IpAddr::from([127, 0, 0, 1])),
                SanType::URI("spiffe://example.org/ns/jobs/sa/worker".try_into().unwrap()),
                SanType::Rfc822Name("ops@example.org".try_into().unwrap()),
                SanType::DnsName("localhost".try_into().unwrap()),
            ],
        );
        assert_eq!(
            certificate_names(&der),
            vec![
                "worker-a",
                "worker-a.jobs.svc",
                "spiffe://example.org/ns/jobs/sa/worker",
                "localhost"
            ]
        );
    }

    #[test]
    fn a_certificate_without_a_common_name_or_without_alternative_names() {
        let only_alternative = certificate(None, vec![SanType::DnsName("svc".try_into().unwrap())]);
        assert_eq!(certificate_names(&only_alternative), vec!["svc"]);
        let only_common = certificate(Some("admin"), Vec::new());
        assert_eq!(certificate_names(&only_common), vec!["admin"]);
    }

    #[test]
    fn what_is_not_a_certificate_has_no_names() {
        let der = certificate(Some("worker-a"), vec![SanType::DnsName("svc".try_into().unwrap())]);
        assert!(certificate_names(&[]).is_empty());
        assert!(certificate_names(b"not a certificate").is_empty());
        for cut in [1, 10, der.len() / 2, der.len() - 1] {
            assert!(certificate_names(&der[..cut]).is_empty(), "cut at {cut}");
        }
        // A long-form length that claims more than there is.
        assert!(certificate_names(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff, 0x30]).is_empty());
    }
}
