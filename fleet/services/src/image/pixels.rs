//! What an image is, read from its first bytes: the MIME type and the pixel size of PNG, JPEG, WebP and GIF
//! (the formats image APIs answer with). Anything else is not an image to the host.

/// A recognised image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sniffed {
    /// `image/png`, `image/jpeg`, `image/webp` or `image/gif`.
    pub(crate) mime: &'static str,
    /// The file extension.
    pub(crate) ext: &'static str,
    /// Width in pixels.
    pub(crate) width: u32,
    /// Height in pixels.
    pub(crate) height: u32,
}

fn be16(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?)))
}

fn le16(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?)))
}

fn le24(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at + 3)?;
    Some(u32::from(s[0]) | u32::from(s[1]) << 8 | u32::from(s[2]) << 16)
}

fn be32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The image `bytes` hold, if they are one of the known formats with a readable size.
pub(crate) fn sniff(bytes: &[u8]) -> Option<Sniffed> {
    let found = |mime, ext, (width, height): (u32, u32)| {
        (width > 0 && height > 0).then_some(Sniffed {
            mime,
            ext,
            width,
            height,
        })
    };
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.get(12..16) == Some(b"IHDR") {
        return found("image/png", "png", (be32(bytes, 16)?, be32(bytes, 20)?));
    }
    if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        return found("image/gif", "gif", (le16(bytes, 6)?, le16(bytes, 8)?));
    }
    if bytes.starts_with(b"RIFF") && bytes.get(8..12) == Some(b"WEBP") {
        return found("image/webp", "webp", webp_size(bytes)?);
    }
    if bytes.starts_with(&[0xFF, 0xD8]) {
        return found("image/jpeg", "jpg", jpeg_size(bytes)?);
    }
    None
}

fn webp_size(b: &[u8]) -> Option<(u32, u32)> {
    match b.get(12..16)? {
        b"VP8 " => Some((le16(b, 26)? & 0x3FFF, le16(b, 28)? & 0x3FFF)),
        b"VP8L" => {
            let bits = u32::from_le_bytes(b.get(21..25)?.try_into().ok()?);
            Some(((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1))
        }
        b"VP8X" => Some((le24(b, 24)? + 1, le24(b, 27)? + 1)),
        _ => None,
    }
}

/// Walks the JPEG segments to the first start-of-frame marker.
fn jpeg_size(b: &[u8]) -> Option<(u32, u32)> {
    let mut at = 2;
    loop {
        // Markers may be padded with fill bytes.
        while *b.get(at)? == 0xFF && *b.get(at + 1)? == 0xFF {
            at += 1;
        }
        if *b.get(at)? != 0xFF {
            return None;
        }
        let marker = *b.get(at + 1)?;
        match marker {
            // Standalone markers: no length.
            0x01 | 0xD0..=0xD7 => at += 2,
            // Start of frame (not DHT 0xC4, JPG 0xC8, DAC 0xCC).
            0xC0..=0xCF if !matches!(marker, 0xC4 | 0xC8 | 0xCC) => {
                return Some((be16(b, at + 7)?, be16(b, at + 5)?));
            }
            0xD9 | 0xDA => return None,
            _ => {
                let len = usize::try_from(be16(b, at + 2)?).ok()?;
                if len < 2 {
                    return None;
                }
                at = at.checked_add(2 + len)?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 3×2 PNG header (the rest of the file does not matter here).
    fn png(w: u32, h: u32) -> Vec<u8> {
        let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        b.extend_from_slice(&w.to_be_bytes());
        b.extend_from_slice(&h.to_be_bytes());
        b.extend_from_slice(&[8, 6, 0, 0, 0]);
        b
    }

    #[test]
    fn reads_the_size_of_each_format() {
        assert_eq!(
            sniff(&png(3, 2)),
            Some(Sniffed {
                mime: "image/png",
                ext: "png",
                width: 3,
                height: 2
            })
        );
        let jpeg = [
            0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x04, 0x00, 0x00, 0xFF, 0xC0, 0x00, 0x11, 0x08, 0x00, 0x20, 0x00,
            0x40,
        ];
        let s = sniff(&jpeg).expect("jpeg");
        assert_eq!((s.mime, s.width, s.height), ("image/jpeg", 64, 32));
        let mut webp = b"RIFF\0\0\0\0WEBPVP8X\0\0\0\0\0\0\0\0".to_vec();
        webp.extend_from_slice(&[0xFF, 0x03, 0x00, 0xFF, 0x01, 0x00]);
        let s = sniff(&webp).expect("webp");
        assert_eq!((s.mime, s.width, s.height), ("image/webp", 1024, 512));
        let gif = b"GIF89a\x05\x00\x07\x00";
        assert_eq!(sniff(gif).map(|s| (s.width, s.height)), Some((5, 7)));
    }

    #[test]
    fn anything_else_is_not_an_image() {
        for bad in [
            &b""[..],
            b"<svg/>",
            b"\x89PNG\r\n\x1a\n",
            &png(0, 5),
            &[0xFF, 0xD8, 0xFF],
            b"RIFF....WEBPXXXX",
        ] {
            assert_eq!(sniff(bad), None, "{bad:?}");
        }
    }
}
